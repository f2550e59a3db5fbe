// statedict: how the executor runs a plan (exec_options) and what a run did (exec_stats); how
// compare() judges two checkpoints (compare_options) and what it found (comparison).
// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace statedict::inline v0 {

/// 256 MiB.
inline constexpr std::uint64_t default_memory_budget = std::uint64_t{256} << 20;

/// What a job is doing when it reports progress (exec_options::progress).
enum class progress_phase : std::uint8_t {
  reading,   ///< reading the input's description (headers, metadata): convert() reports it
  planning,  ///< working out where every byte goes (make_plan), before the copy
  copying,   ///< the executor writes the planned bytes
  syncing,   ///< the output files are flushed to disk and moved into place
};

/// One progress report.
struct progress_event {
  progress_phase phase = progress_phase::copying;
  /// Bytes the copy has written, and will write in all (0 before the copy is planned).
  std::uint64_t done = 0, total = 0;
  /// The file the job is on (empty when not known; valid during the call only): reading, the
  /// input; copying, the destination the last bytes went to (its name in the plan); syncing, the
  /// output file being flushed.
  std::string_view file;
};

/// How to run a plan. The defaults are the fastest measured on ext4 (the figures behind each:
/// bench/HISTORY.md, "the figures behind the executor's defaults"; docs/planner.md).
struct exec_options {
  /// Bytes of buffers the executor may allocate in all (threads included).
  std::uint64_t memory_budget = default_memory_budget;
  /// Worker threads (the calling thread is one of them); 0 means one per CPU.
  unsigned threads = 1;
  /// Called with what the job is doing, one call at a time: while copying from worker threads,
  /// at most about a thousand times per run and once at the end; the writers also report planning
  /// before the copy and syncing after it, and convert() reading before them. Rendering (and
  /// throttling to a screen's pace) is the caller's.
  std::function<void(const progress_event&)> progress;
  /// Allow writes straight from source mappings (and copy_file_range, when that is on too).
  bool zero_copy = true;
  /// Let the kernel copy plain runs between files (copy_file_range) instead of the executor's
  /// reads and writes. Off by default: on ext4 it writes the destination a 4 KiB page at a time,
  /// and the writeback of those pages costs more than the copy it saves.
  bool copy_file_range = false;
  /// Smallest run handed to copy_file_range.
  std::uint64_t copy_file_range_min = std::uint64_t{1} << 20;
  /// Smallest run written straight from a source mapping (smaller ones are gathered).
  std::uint64_t direct_write_min = std::uint64_t{64} << 10;
  /// Release the pages of mapped sources once the copy has used them (and advise the mappings
  /// MADV_SEQUENTIAL, and MADV_HUGEPAGE with large_folios).
  bool release_source_pages = true;
  /// Bytes of mapped sources a thread leaves mapped before it releases them (with
  /// release_source_pages; 0: after every work item). The ranges it used, neighbours in one file
  /// joined, are released together once they reach this size and when the thread ends: fewer
  /// madvise calls (each flushes the other threads' TLBs), at the cost of up to this much more
  /// resident memory per thread.
  std::uint64_t release_after = std::uint64_t{8} << 20;
  /// Ask that mapped sources be read into the page cache in 2 MiB folios and mapped whole
  /// (MADV_HUGEPAGE; takes effect where transparent huge pages are "madvise" or "always"), so that
  /// a copy out of them pays a page-table entry per 2 MiB rather than per 4 KiB.
  bool large_folios = true;
  /// Bytes of mapped sources a helper thread reads into the page cache ahead of the copy (0: none;
  /// with large_folios and release_source_pages only): the ranges the plan reads, in plan order,
  /// 8 MiB at a time, what is cached already skipped, in 2 MiB folios. Started only for jobs that
  /// read 16 MiB or more. Without it a cold source is read by the copy's own page faults, each
  /// waited for.
  std::uint64_t read_ahead = std::uint64_t{64} << 20;
  /// Read sources that have a file descriptor with pread, even when they are mapped, rather than
  /// writing from or casting out of the mapping (two copies of each byte instead of one). Off: the
  /// executor maps a run's pages in one call (MADV_POPULATE_READ) and writes straight from the
  /// mapping.
  bool pread_files = false;
  /// Largest buffer per thread and direction. 1 MiB: a block read with pread is still in the
  /// core's cache when pwrite copies it out.
  std::uint64_t max_block = std::uint64_t{1} << 20;
  /// Output files (FileSink::use_direct_io, by the format writers) are written with O_DIRECT
  /// where the file system supports it (statx STATX_DIOALIGN: ext4, XFS, Btrfs; not tmpfs): each
  /// byte is copied once, into a 1 MiB aligned buffer, and goes from there to the disk, instead of
  /// being copied into the page cache, tracked there block by block and written back. Off: through
  /// the page cache, with writeback started every 64 MiB (for a cold input on a busy disk this can
  /// be faster: the reads do not compete with the writes).
  bool direct_io = true;
};

/// What a run did.
struct exec_stats {
  std::uint64_t bytes_written = 0;       ///< destination bytes produced
  std::uint64_t bytes_in_kernel = 0;     ///< of which copied by copy_file_range
  std::uint64_t bytes_from_mapping = 0;  ///< of which written straight from a source mapping
  std::uint64_t bytes_converted = 0;     ///< of which produced by a dtype conversion
  std::uint64_t elements_compared = 0;   ///< replica elements checked
  std::uint64_t bytes_read_ahead = 0;    ///< source bytes read into the page cache ahead of the copy
  std::uint64_t ranges_released = 0;     ///< ranges of source mappings released (madvise calls)
  std::uint64_t buffer_bytes = 0;        ///< peak bytes of the executor's own buffers
  std::uint64_t block_bytes = 0;         ///< buffer size per thread and direction
  std::uint64_t work_items = 0;
  unsigned threads = 0;
};

/// How compare() judges elements and how much it reports.
struct compare_options {
  /// With rtol or atol > 0, floating elements a and b are equal when |a - b| <= atol + rtol * |b|
  /// (compared in F64; NaN equals NaN), and floating dtypes may differ between the two sides.
  double rtol = 0;
  double atol = 0;
  exec_options exec{};
  /// Differences listed in full; the rest are counted in `omitted`.
  std::size_t max_report = 20;
  /// Elements per comparison block.
  std::uint64_t block_elements = std::uint64_t{1} << 19;
};

/// What compare() found.
struct comparison {
  /// One line per difference ("tensor 'w': element [3, 1] differs (A 1, B 2)").
  std::vector<std::string> differences;
  std::size_t omitted = 0;
  std::size_t tensors = 0;  ///< tensors present on both sides
  std::size_t values = 0;   ///< non-tensor values present on both sides
  [[nodiscard]] bool equal() const { return differences.empty() && omitted == 0; }
};

}  // namespace statedict::inline v0
