// statedict: the streaming executor. Runs a Plan (shard/plan.hpp) from byte sources into sinks
// with a fixed memory budget, any number of threads, exact casts on the fly, and zero-copy paths.
// SPDX-License-Identifier: MIT
//
// Memory: every buffer the executor allocates is counted (exec_stats::buffer_bytes) and the total
// stays within exec_options::memory_budget whatever the plan: per thread one read buffer and one
// write buffer of `block` bytes plus two 64 KiB conversion buffers, with
// block = (budget / threads - 128 KiB) / 2, at most 1 MiB. Mapped sources are read in place and
// the pages an item has consumed are released (MADV_DONTNEED), so file-backed memory does not
// accumulate either; sources without a mapping (`--io pread`) are read with pread. Mapped files
// are advised MADV_SEQUENTIAL and MADV_HUGEPAGE (exec_options::large_folios): what the copy reads
// in from disk is cached in 2 MiB folios, which later copies map with one entry each. Before the
// copy, blocks of 2 MiB it reads that hold only a few cached pages (a format's headers, read with
// pread) are dropped, so they too can be read in whole; and a helper thread reads the ranges the
// plan reads ahead of the copy (exec_options::read_ahead), skipping what is cached.
//
// Copy paths for runs that need no conversion, in the order they are tried:
//   * copy_file_range between the source file and the destination file (when asked for:
//     exec_options::copy_file_range; runs >= 1 MiB, plain files, sinks that need not see the
//     bytes); the kernel copies page cache to page cache;
//   * one positioned write straight from the source mapping (runs >= 64 KiB), after one
//     MADV_POPULATE_READ has mapped the run's pages: each byte is copied once, by the kernel, from
//     the source's page cache into the destination's, and the write takes no page faults;
//   * runs of a source without a mapping (or with exec_options::pread_files) are read with pread
//     into the write buffer, gathered with the runs before them when contiguous, and written in
//     blocks (two copies, as `cp` makes);
//   * small runs are gathered into the write buffer and written together when contiguous. Small
//     runs of several operations that interleave in one destination, row by row (a tensor split
//     along a dimension other than the first: Megatron-LM's row-parallel weights, dim-1 DCP
//     chunks), are walked row by row across the operations, so the destination is written front to
//     back in blocks rather than one write per run.
// Conversions read from the mapping (or pread into the read buffer) and cast into the write buffer
// with core/cast.hpp's exact rounding. docs/planner.md has what each path cost.
//
// Threads take work items (at most one block of bytes each, or a batch of small operations of one
// destination) in plan order, so each source is read front to back, except that a thread skips
// ahead to the first item of a destination no other thread is writing when there is one, and
// waits rather than copy into a file another thread is writing (casts excepted: their work is
// CPU outside the write). Writes into one file serialize on its inode lock, and two threads
// writing the same file spent a fifth of their time spinning on it (ZeRO-3 8 ranks -> DCP 3
// ranks, perf: rwsem_spin_on_owner 17%; one .safetensors output: 26%). Sinks that write with
// direct I/O (Sink::concurrent_writes) are shared: there one thread copies while another waits
// for the disk. Writes never overlap (the
// plan is proven), so the output bytes do not depend on the thread count or on timing. Ordered
// sinks (Sha256Sink) are written by one thread, in increasing offsets: their operations form one
// work item that walks them in destination order.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "../core/cast.hpp"
#include "../core/error.hpp"
#include "../core/source.hpp"
#include "../io/file.hpp"
#include "../shard/plan.hpp"
#include "options.hpp"
#include "sink.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id sink_missing     {652, error_kind::usage,  "exec.sink_missing"};
inline constexpr error_id source_mismatch  {653, error_kind::usage,  "exec.source_mismatch"};
inline constexpr error_id replica_mismatch {654, error_kind::format, "exec.replica_mismatch"};
inline constexpr error_id budget_too_small {655, error_kind::usage,  "exec.budget_too_small"};
inline constexpr error_id copy_failed      {656, error_kind::io,     "exec.copy_failed"};
// clang-format on
}  // namespace errors

namespace detail {

/// Counts the executor's buffer bytes (current and peak).
class exec_ledger {
 public:
  void add(std::uint64_t n) noexcept {
    const std::uint64_t c = current_.fetch_add(n) + n;
    std::uint64_t p = peak_.load();
    while (c > p && !peak_.compare_exchange_weak(p, c)) {
    }
  }
  void sub(std::uint64_t n) noexcept { current_.fetch_sub(n); }
  [[nodiscard]] std::uint64_t peak() const noexcept { return peak_.load(); }

 private:
  std::atomic<std::uint64_t> current_{0}, peak_{0};
};

/// A buffer allocated once, on first use, and counted.
class exec_buffer {
 public:
  exec_buffer(exec_ledger& l, std::uint64_t size) : ledger_(l), size_(size) {}
  exec_buffer(const exec_buffer&) = delete;
  exec_buffer& operator=(const exec_buffer&) = delete;
  ~exec_buffer() {
    if (data_) ledger_.sub(size_);
  }
  std::byte* get() {
    if (!data_) {
      data_.reset(new std::byte[static_cast<std::size_t>(size_)]);
      ledger_.add(size_);
    }
    return data_.get();
  }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  exec_ledger& ledger_;
  std::uint64_t size_;
  std::unique_ptr<std::byte[]> data_;
};

struct exec_item {
  enum class kind : std::uint8_t { ops, lane, compare, rows };
  kind what = kind::ops;
  std::uint32_t begin = 0, end = 0;  ///< ops / checks [begin, end); lane, rows: index of the lane / group
  std::uint64_t e0 = 0, e1 = 0;      ///< element range of op `begin` when sliced (e1 > 0); rows: [e0, e1)
  std::uint32_t dst = no_dst;        ///< the one destination an ops item writes
  bool converts = false;             ///< some of its operations cast (CPU work outside the write)
  static constexpr std::uint32_t no_dst = 0xffffffffU;
};

/// Hands out work items: in order, but preferring the first item of a destination that no
/// thread is writing. Items are at most a block each, so one lock per item costs nothing.
class exec_scheduler {
 public:
  /// `shared[d]`: destination d takes writes from several threads at once (Sink::concurrent_writes).
  void init(const std::vector<exec_item>& items, std::size_t destinations, std::vector<std::uint8_t> shared) {
    shared_ = std::move(shared);
    shared_.resize(destinations + 1, 0);
    // One queue per destination, and a last one for items that write no file (never busy).
    const std::size_t queues = destinations + 1;
    next_.assign(queues, 0);
    queue_.assign(queues, {});
    busy_.assign(queues, 0);
    for (std::uint32_t i = 0; i < items.size(); ++i) queue_[queue_of(items[i], destinations)].push_back(i);
    for (std::uint32_t d = 0; d < queues; ++d)
      if (!queue_[d].empty()) open_.push_back(d);
    taken_.assign(items.size(), 0);
    destinations_ = destinations;
  }

  /// The next item for a thread that has just finished writing `prev` (no_dst: none), or
  /// `count` when all are taken. A thread waits rather than take a plain copy into a file another
  /// thread is writing: the two would only take turns on the file's lock, spinning (a single
  /// output file written by two threads: 1.8x the CPU time of one thread, and slower).
  std::size_t take(const std::vector<exec_item>& items, std::uint32_t prev, const std::atomic<bool>& stop) {
    std::unique_lock<std::mutex> lock(m_);
    if (prev != exec_item::no_dst) {
      --busy_[prev];
      freed_.notify_all();
    }
    for (;;) {
      while (head_ < items.size() && taken_[head_]) ++head_;
      if (head_ == items.size() || stop.load()) return items.size();
      std::size_t pick = head_;
      if (busy_[queue_of(items[head_], destinations_)] > 0) {
        std::size_t best = items.size();
        for (std::size_t k = 0; k < open_.size();) {
          const std::uint32_t d = open_[k];
          auto& q = queue_[d];
          while (next_[d] < q.size() && taken_[q[next_[d]]]) ++next_[d];
          if (next_[d] == q.size()) {  // drained: drop it from the scan
            open_[k] = open_.back();
            open_.pop_back();
            continue;
          }
          if (busy_[d] == 0 && q[next_[d]] < best) best = q[next_[d]];
          ++k;
        }
        if (best < items.size()) pick = best;
      }
      const exec_item& it = items[pick];
      if (it.dst != exec_item::no_dst && busy_[it.dst] > 0 && !it.converts && !shared_[it.dst]) {
        freed_.wait(lock);  // woken when a thread finishes an item (or stops)
        continue;
      }
      taken_[pick] = 1;
      if (it.dst != exec_item::no_dst) ++busy_[it.dst];
      return pick;
    }
  }

  /// Wakes waiting threads (after an error).
  void wake_all() {
    std::lock_guard<std::mutex> lock(m_);
    freed_.notify_all();
  }

 private:
  static std::size_t queue_of(const exec_item& it, std::size_t destinations) noexcept {
    return it.dst == exec_item::no_dst ? destinations : it.dst;
  }

  std::mutex m_;
  std::condition_variable freed_;
  std::size_t destinations_ = 0;
  std::size_t head_ = 0;
  std::vector<std::vector<std::uint32_t>> queue_;
  std::vector<std::size_t> next_;
  std::vector<std::uint32_t> busy_, open_;
  std::vector<std::uint8_t> taken_, shared_;
};

/// The kernel's fault-around window (vm fault_around_bytes, 64 KiB by default): a page fault, and
/// MADV_POPULATE_READ, map the cached pages of the whole aligned window around the page needed.
inline constexpr std::uint64_t fault_around_window = std::uint64_t{64} << 10;
/// What one entry maps of a 2 MiB folio (a PMD on x86-64 and arm64 with 4 KiB pages).
inline constexpr std::uint64_t large_folio_window = std::uint64_t{2} << 20;

/// A byte range of a mapped file.
struct file_extent {
  const InputFile* file = nullptr;
  std::uint64_t lo = 0, hi = 0;
};

/// The mapped file under [offset, offset + length) of a source (itself, or the file a slice of
/// it is cut from) and the range there, clipped to the file; nothing when there is none.
inline std::optional<file_extent> extent_of(const ByteSource& s, std::uint64_t offset, std::uint64_t length) {
  const ByteSource* p = &s;
  while (const auto* sl = dynamic_cast<const SliceSource*>(p)) {
    offset += sl->offset();
    p = sl->base().get();
  }
  const auto* f = dynamic_cast<const InputFile*>(p);
  if (!f || !f->data() || offset >= f->size()) return std::nullopt;
  return file_extent{f, offset, offset + std::min(length, f->size() - offset)};
}

/// Releases the pages of [offset, offset + length) of a mapped file source, widened to the
/// windows it touches: `window` is what one fault maps (the fault-around window, or a whole
/// 2 MiB folio where they are mapped whole). Released by the range alone, the pages just before
/// and after it, mapped with it, stayed mapped once their own range had been released (about 4%
/// of the bytes a job copied, so the mapped inputs' RSS grew with the job); and a range that ends
/// inside a 2 MiB mapping splits it into 512 entries first. A page of a neighbouring range
/// released early is mapped again when it is used.
inline void release_pages(const ByteSource& s, std::uint64_t offset, std::uint64_t length,
                          std::uint64_t window = fault_around_window) {
  const auto e = extent_of(s, offset, length);
  if (!e) return;
  const auto base = reinterpret_cast<std::uintptr_t>(e->file->data());  // windows are aligned in memory
  const std::uint64_t lo = e->lo - std::min<std::uint64_t>(e->lo, (base + e->lo) % window);
  const std::uint64_t hi = std::min(e->file->size(), e->hi + (window - (base + e->hi) % window) % window);
  if (hi > lo) e->file->advise(lo, hi - lo, access_hint::dontneed);
}

/// Maps the pages of [offset, offset + length) of a mapped file source in one call, so that the
/// copy out of the mapping (a pwrite from it, or a cast) takes no page faults.
inline void populate_pages(const ByteSource& s, std::uint64_t offset, std::uint64_t length) {
  if (const auto e = extent_of(s, offset, length)) e->file->advise(e->lo, e->hi - e->lo, access_hint::populate);
}

/// Advises every mapped file under the sources, once each: read front to back, and (large_folios)
/// in 2 MiB folios.
inline void advise_sources(std::span<const std::shared_ptr<const ByteSource>> sources, bool large_folios) {
  std::vector<const InputFile*> files;
  for (const auto& src : sources)
    if (const auto e = src ? extent_of(*src, 0, 0) : std::nullopt) files.push_back(e->file);
  std::sort(files.begin(), files.end());
  files.erase(std::unique(files.begin(), files.end()), files.end());
  for (const InputFile* f : files) {
    f->advise(0, f->size(), access_hint::sequential);
    if (large_folios) f->advise(0, f->size(), access_hint::large_folios);
  }
}

/// The mapped ranges the plan's operations read, in plan order, neighbours less than 64 KiB
/// apart in one file joined.
inline std::vector<file_extent> read_extents(const Plan& plan, std::span<const std::shared_ptr<const ByteSource>> sources) {
  std::vector<file_extent> out;
  for (const CopyOp& o : plan.ops) {
    if (o.src >= sources.size() || !sources[o.src] || o.reps == 0 || o.count == 0) continue;
    const std::uint64_t len = (o.reps - 1) * o.src_step + o.count * itemsize(o.src_dtype);
    const auto e = extent_of(*sources[o.src], o.src_offset, len);
    if (!e) continue;
    if (!out.empty() && out.back().file == e->file && e->lo >= out.back().lo && e->lo <= out.back().hi + (64 << 10)) {
      out.back().hi = std::max(out.back().hi, e->hi);
    } else {
      out.push_back(*e);
    }
  }
  return out;
}

/// Reports `phase` to opt.progress, when there is one.
inline void report_progress(const exec_options& opt, progress_phase phase, std::uint64_t done = 0, std::uint64_t total = 0,
                            std::string_view file = {}) {
  if (opt.progress) opt.progress(progress_event{phase, done, total, file});
}

struct exec_shared {
  const Plan& plan;
  std::span<const std::shared_ptr<const ByteSource>> sources;
  std::span<Sink* const> sinks;
  const exec_options& opt;
  std::uint64_t block = 0;
  std::vector<exec_item> items;
  std::vector<std::vector<std::uint32_t>> lanes;
  std::vector<std::vector<std::uint32_t>> groups;  ///< interleaved operations, in destination order
  exec_ledger ledger;
  exec_scheduler scheduler;
  std::atomic<bool> stop{false};
  std::atomic<bool> cfr_ok{true};
  std::mutex error_mutex;
  std::exception_ptr error;
  std::atomic<std::uint64_t> done{0}, in_kernel{0}, from_mapping{0}, converted{0}, compared{0};
  std::atomic<std::uint64_t> consumed{0};  ///< bytes of mapped sources the copy has used (paces read_ahead)
  std::atomic<bool> copied{false};         ///< the workers are done
  std::atomic<std::uint64_t> read_ahead_bytes{0};
  std::atomic<std::uint64_t> ranges_released{0};
  std::uint64_t total = 0;
  std::uint64_t progress_step = 1;
  std::atomic<std::uint64_t> next_report{0};
  std::mutex progress_mutex;

  exec_shared(const Plan& p, std::span<const std::shared_ptr<const ByteSource>> s, std::span<Sink* const> k,
              const exec_options& o)
      : plan(p), sources(s), sinks(k), opt(o) {}

  /// Counts `n` bytes written into `to`; reports progress every progress_step bytes.
  void progress(std::uint64_t n, const Sink* to) {
    const std::uint64_t d = done.fetch_add(n) + n;
    if (!opt.progress) return;
    std::uint64_t due = next_report.load();
    if (d < due && d < total) return;
    std::lock_guard<std::mutex> lock(progress_mutex);
    due = next_report.load();
    if (d < due && d < total) return;
    next_report.store(d + progress_step);
    std::string_view file;
    for (std::size_t k = 0; k < sinks.size() && k < plan.destination_names.size(); ++k)
      if (sinks[k] == to) {
        file = plan.destination_names[k];
        break;
      }
    opt.progress(progress_event{progress_phase::copying, std::min(done.load(), total), total, file});
  }
};

/// What the read-ahead helper reads at a time.
inline constexpr std::uint64_t read_ahead_step = std::uint64_t{8} << 20;

/// Reads the plan's mapped ranges into the page cache ahead of the workers, 8 MiB at a time,
/// at most opt.read_ahead bytes ahead of what they have used. Best effort: what it cannot read
/// (no memory for a mapping, an I/O error) is left to the copy's own faults, which report it.
inline void read_ahead(exec_shared& s, const std::vector<file_extent>& extents) noexcept try {
  constexpr std::uint64_t step = read_ahead_step;
  std::uint64_t issued = 0;
  for (const file_extent& e : extents) {
    for (std::uint64_t at = e.lo; at < e.hi;) {
      const std::uint64_t n = std::min(step, e.hi - at);
      if (s.copied.load() || s.stop.load()) return;
      // What is cached costs no wait: a warm run passes straight through. A page per MiB is asked
      // about (mincore looks up every page it is given): this helper reads whole steps.
      if (!e.file->cached(at, n, std::uint64_t{1} << 20)) {
        while (issued > s.consumed.load(std::memory_order_relaxed) + s.opt.read_ahead) {
          if (s.copied.load() || s.stop.load()) return;
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        if (e.file->read_ahead(at, n, s.opt.large_folios)) s.read_ahead_bytes.fetch_add(n);
      }
      issued += n;
      at += n;
    }
  }
} catch (...) {
}

class exec_worker {
 public:
  explicit exec_worker(exec_shared& s)
      : s_(s), rbuf_(s.ledger, s.block), wbuf_(s.ledger, s.block), tmp_a_(s.ledger, tmp_size), tmp_b_(s.ledger, tmp_size) {}

  void run() {
    try {
      std::uint32_t prev = exec_item::no_dst;
      for (;;) {
        if (s_.stop.load()) break;
        const std::size_t i = s_.scheduler.take(s_.items, prev, s_.stop);
        if (i >= s_.items.size()) break;
        do_item(s_.items[i]);
        prev = s_.items[i].dst;
      }
      release();
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(s_.error_mutex);
        if (!s_.error) s_.error = std::current_exception();
        s_.stop.store(true);
      }
      s_.scheduler.wake_all();
    }
  }

 private:
  static constexpr std::uint64_t tmp_size = std::uint64_t{64} << 10;

  void do_item(const exec_item& it) {
    switch (it.what) {
      case exec_item::kind::ops:
        if (it.e1 > 0) {
          do_op(s_.plan.ops[it.begin], it.e0, it.e1);
        } else {
          for (std::uint32_t k = it.begin; k < it.end; ++k) do_op(s_.plan.ops[k], 0, s_.plan.ops[k].elements());
        }
        break;
      case exec_item::kind::lane: do_lane(s_.lanes[it.begin]); break;
      case exec_item::kind::rows: do_rows(s_.groups[it.begin], it.e0, it.e1); break;
      case exec_item::kind::compare:
        for (std::uint32_t k = it.begin; k < it.end; ++k) do_compare(s_.plan.checks[k]);
        break;
    }
    flush();
    release_some();
  }

  // ---- copies --------------------------------------------------------------------------------

  void do_op(const CopyOp& o, std::uint64_t e0, std::uint64_t e1) {
    const ByteSource& src = *s_.sources[o.src];
    Sink& dst = *s_.sinks[o.dst];
    const std::uint64_t ssz = itemsize(o.src_dtype), dsz = itemsize(o.dst_dtype);
    for (std::uint64_t e = e0; e < e1;) {
      const std::uint64_t r = e / o.count, w = e % o.count;
      const std::uint64_t n = std::min(o.count - w, e1 - e);
      run(o, src, dst, o.src_offset + r * o.src_step + w * ssz, o.dst_offset + r * o.dst_step + w * dsz, n);
      e += n;
    }
  }

  /// Ordered destination: all its runs in increasing destination offset.
  void do_lane(const std::vector<std::uint32_t>& ops) {
    std::vector<detail::Pattern> pats;
    pats.reserve(ops.size());
    for (std::uint32_t k : ops) {
      const CopyOp& o = s_.plan.ops[k];
      pats.push_back(detail::Pattern{o.dst_offset, o.count * itemsize(o.dst_dtype), o.reps, o.dst_step, k});
    }
    detail::for_each_run_merged(std::span<const detail::Pattern>(pats),
                                [&](std::uint64_t start, std::uint64_t, std::uint32_t k, std::uint64_t rep) {
                                  if (s_.stop.load()) return false;
                                  const CopyOp& o = s_.plan.ops[k];
                                  run(o, *s_.sources[o.src], *s_.sinks[o.dst], o.src_offset + rep * o.src_step, start, o.count);
                                  return true;
                                });
  }

  /// Rows [r0, r1) of a group of interleaved operations (same destination, repetitions and
  /// destination step; their runs side by side in each row): row after row, each operation's run
  /// in destination order, so consecutive runs continue each other in the write buffer.
  void do_rows(const std::vector<std::uint32_t>& group, std::uint64_t r0, std::uint64_t r1) {
    for (std::uint32_t k : group) {  // each operation's source rows at once: one populate, not a fault a page
      const CopyOp& o = s_.plan.ops[k];
      const ByteSource& src = *s_.sources[o.src];
      if (!mapping(src)) continue;
      const std::uint64_t so = o.src_offset + r0 * o.src_step;
      const std::uint64_t bytes = (r1 - r0 - 1) * o.src_step + o.count * itemsize(o.src_dtype);
      touch(o.src, so, bytes);
      if (bytes <= 2 * s_.block) populate_pages(src, so, bytes);
    }
    for (std::uint64_t r = r0; r < r1; ++r) {
      if (s_.stop.load()) return;
      for (std::uint32_t k : group) {
        const CopyOp& o = s_.plan.ops[k];
        const ByteSource& src = *s_.sources[o.src];
        Sink& dst = *s_.sinks[o.dst];
        const std::uint64_t so = o.src_offset + r * o.src_step, doff = o.dst_offset + r * o.dst_step;
        if (o.plain())
          plain(src, dst, so, doff, o.count * itemsize(o.src_dtype));
        else
          converted(o, src, dst, so, doff, o.count);
      }
    }
  }

  void run(const CopyOp& o, const ByteSource& src, Sink& dst, std::uint64_t so, std::uint64_t doff, std::uint64_t n) {
    if (mapping(src)) {
      const std::uint64_t bytes = n * itemsize(o.src_dtype);
      touch(o.src, so, bytes);
      if (bytes >= s_.opt.direct_write_min) populate_pages(src, so, bytes);
    }
    if (o.plain())
      plain(src, dst, so, doff, n * itemsize(o.src_dtype));
    else
      converted(o, src, dst, so, doff, n);
  }

  void plain(const ByteSource& src, Sink& dst, std::uint64_t so, std::uint64_t doff, std::uint64_t len) {
    if (s_.opt.copy_file_range && len >= s_.opt.copy_file_range_min && s_.opt.zero_copy && s_.cfr_ok.load() && src.fd() >= 0 && dst.fd() >= 0 &&
        !dst.needs_bytes() && !dst.ordered()) {
      flush();
      const std::uint64_t k = kernel_copy(src, so, dst, doff, len);
      s_.in_kernel.fetch_add(k);
      s_.progress(k, &dst);
      so += k;
      doff += k;
      len -= k;
      if (len == 0) return;
    }
    const std::byte* map = mapping(src);
    if (map && s_.opt.zero_copy && len >= s_.opt.direct_write_min) {
      flush();
      src.check_range(so, len);
      dst.write(doff, std::span<const std::byte>(map + so, static_cast<std::size_t>(len)));
      s_.from_mapping.fetch_add(len);
      s_.progress(len, &dst);
      return;
    }
    while (len) {
      const std::uint64_t k = std::min(len, s_.block);
      std::byte* p = reserve(dst, doff, k);
      read(src, so, std::span<std::byte>(p, static_cast<std::size_t>(k)));
      commit(k);
      so += k;
      doff += k;
      len -= k;
    }
  }

  void converted(const CopyOp& o, const ByteSource& src, Sink& dst, std::uint64_t so, std::uint64_t doff, std::uint64_t n) {
    const std::uint64_t ssz = itemsize(o.src_dtype), dsz = itemsize(o.dst_dtype);
    const std::uint64_t per = std::max<std::uint64_t>(1, s_.block / std::max(ssz, dsz));
    const std::byte* map = mapping(src);
    while (n) {
      const std::uint64_t k = std::min(n, per);
      const std::byte* sp;
      if (map && !o.swap) {
        src.check_range(so, k * ssz);
        sp = map + so;
      } else {
        // Read into the buffer (big-endian elements are swapped there, never in the source).
        std::byte* b = rbuf_.get();
        if (map) {
          src.check_range(so, k * ssz);
          std::memcpy(b, map + so, static_cast<std::size_t>(k * ssz));
        } else {
          read(src, so, std::span<std::byte>(b, static_cast<std::size_t>(k * ssz)));
        }
        if (o.swap) byteswap_run(o.src_dtype, b, static_cast<std::size_t>(k));
        sp = b;
      }
      std::byte* dp = reserve(dst, doff, k * dsz);
      convert(o, sp, dp, k);
      commit(k * dsz);
      s_.converted.fetch_add(k * dsz);
      so += k * ssz;
      doff += k * dsz;
      n -= k;
    }
  }

  /// Casts k elements along the op's chain, through the conversion buffers when it has steps.
  void convert(const CopyOp& o, const std::byte* sp, std::byte* dp, std::uint64_t k) {
    if (o.nvia == 0) {
      cast_run(o.src_dtype, sp, o.dst_dtype, dp, static_cast<std::size_t>(k));
      return;
    }
    dtype chain[4] = {o.src_dtype, o.via[0], o.via[1], o.dst_dtype};
    if (o.nvia == 1) chain[2] = o.dst_dtype;
    const std::size_t steps = static_cast<std::size_t>(o.nvia) + 1;
    std::size_t widest = 1;
    for (std::size_t j = 0; j <= steps; ++j) widest = std::max(widest, itemsize(chain[j]));
    const std::uint64_t m = tmp_size / widest;
    std::byte* tmp[2] = {tmp_a_.get(), tmp_b_.get()};
    for (std::uint64_t i = 0; i < k; i += m) {
      const std::uint64_t c = std::min(m, k - i);
      const std::byte* in = sp + i * itemsize(chain[0]);
      for (std::size_t j = 0; j < steps; ++j) {
        std::byte* out = j + 1 == steps ? dp + i * itemsize(chain[steps]) : tmp[j % 2];
        cast_run(chain[j], in, chain[j + 1], out, static_cast<std::size_t>(c));
        in = out;
      }
    }
  }

  /// The source's mapping when copies read from it, nullptr when they read with pread.
  const std::byte* mapping(const ByteSource& src) const noexcept {
    return s_.opt.pread_files && src.fd() >= 0 ? nullptr : src.data();
  }

  /// Reads source bytes: pread from the descriptor when the source has one (pread_files), else
  /// ByteSource::read.
  void read(const ByteSource& src, std::uint64_t so, std::span<std::byte> out) {
    if (!s_.opt.pread_files || src.fd() < 0) {
      src.read(so, out);
      return;
    }
    src.check_range(so, out.size());
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t r = ::pread(src.fd(), out.data() + done, out.size() - done,
                                static_cast<off_t>(src.fd_offset() + so + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw_error(errors::read_failed, "file " + quote(src.name()),
                    "read at offset " + std::to_string(src.fd_offset() + so + done) + " failed: " + detail::errno_text(errno));
      }
      if (r == 0)
        throw_error(errors::file_shrank, "file " + quote(src.name()),
                    "ends at offset " + std::to_string(src.fd_offset() + so + done) + ", shorter than when opened");
      done += static_cast<std::size_t>(r);
    }
  }

  /// copy_file_range as far as it goes; returns the bytes copied (0 when not possible).
  std::uint64_t kernel_copy(const ByteSource& src, std::uint64_t so, Sink& dst, std::uint64_t doff, std::uint64_t len) {
    std::uint64_t copied = 0;
    while (copied < len) {
      auto in = static_cast<loff_t>(src.fd_offset() + so + copied);
      auto out = static_cast<loff_t>(dst.fd_offset() + doff + copied);
      const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(len - copied, std::uint64_t{1} << 30));
      const ssize_t r = ::copy_file_range(src.fd(), &in, dst.fd(), &out, want, 0);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP || errno == EBADF ||
            errno == EPERM || errno == ETXTBSY) {
          s_.cfr_ok.store(false);  // not for these files: positioned writes from now on
          return copied;
        }
        throw_error(errors::copy_failed, "file " + quote(dst.name()),
                    "copy_file_range from " + quote(src.name()) + " failed: " + detail::errno_text(errno));
      }
      if (r == 0) return copied;  // the source ended early: the read path reports it
      copied += static_cast<std::uint64_t>(r);
    }
    return copied;
  }

  // ---- write buffer ----------------------------------------------------------------------------

  std::byte* reserve(Sink& dst, std::uint64_t off, std::uint64_t len) {
    if (acc_len_ && (acc_sink_ != &dst || acc_off_ + acc_len_ != off || acc_len_ + len > s_.block)) flush();
    std::byte* b = wbuf_.get();
    if (!acc_len_) {
      acc_sink_ = &dst;
      acc_off_ = off;
    }
    return b + acc_len_;
  }
  void commit(std::uint64_t len) noexcept { acc_len_ += len; }
  void flush() {
    if (!acc_len_) return;
    const std::uint64_t n = acc_len_;
    acc_len_ = 0;
    acc_sink_->write(acc_off_, std::span<const std::byte>(wbuf_.get(), static_cast<std::size_t>(n)));
    s_.progress(n, acc_sink_);
  }

  // ---- pages of mapped sources ----------------------------------------------------------------

  /// Notes that [off, off + len) of mapped source `src` is being used; released once the ranges
  /// this thread holds reach opt.release_after bytes. A range within one release window of
  /// another of the same source extends it (the windows around them would overlap anyway).
  void touch(std::uint32_t src, std::uint64_t off, std::uint64_t len) {
    if (!s_.opt.release_source_pages || !s_.sources[src]->data()) return;
    s_.consumed.fetch_add(len, std::memory_order_relaxed);
    const std::uint64_t gap = release_window();
    for (auto& t : touched_) {
      if (t.src != src || off > t.hi + gap || off + len + gap < t.lo) continue;
      touched_bytes_ -= t.hi - t.lo;
      t.lo = std::min(t.lo, off);
      t.hi = std::max(t.hi, off + len);
      touched_bytes_ += t.hi - t.lo;
      return;
    }
    if (touched_.size() >= 64) release();
    touched_.push_back({src, off, off + len});
    touched_bytes_ += len;
  }
  void release_some() {
    if (touched_bytes_ >= s_.opt.release_after) release();
  }
  void release() {
    for (const auto& t : touched_) release_pages(*s_.sources[t.src], t.lo, t.hi - t.lo, release_window());
    s_.ranges_released.fetch_add(touched_.size(), std::memory_order_relaxed);
    touched_.clear();
    touched_bytes_ = 0;
  }
  [[nodiscard]] std::uint64_t release_window() const noexcept {
    return s_.opt.large_folios ? large_folio_window : fault_around_window;
  }

  // ---- replica checks --------------------------------------------------------------------------

  /// `len` bytes at `off` of `src`: in place when mapped, else read into `buf`; elements of dtype
  /// `swap` are byte-swapped in `buf` (big-endian sources).
  const std::byte* bytes_of(const ByteSource& src, std::uint64_t off, std::uint64_t len, exec_buffer& buf, std::optional<dtype> swap) {
    const std::byte* m = src.data();
    if (m && !swap) {
      src.check_range(off, len);
      return m + off;
    }
    std::byte* b = buf.get();
    if (m) {
      src.check_range(off, len);
      std::memcpy(b, m + off, static_cast<std::size_t>(len));
    } else {
      src.read(off, std::span<std::byte>(b, static_cast<std::size_t>(len)));
    }
    if (swap) byteswap_run(*swap, b, static_cast<std::size_t>(len / itemsize(*swap)));
    return b;
  }

  void do_compare(const CompareOp& c) {
    flush();
    const ByteSource& a = *s_.sources[c.a];
    const ByteSource& b = *s_.sources[c.b];
    const std::uint64_t asz = itemsize(c.a_dtype), bsz = itemsize(c.b_dtype), lsz = itemsize(c.logical);
    const bool same = c.a_dtype == c.b_dtype;
    // Elements per step: both reads fit their buffer; converted values fit the conversion buffers.
    std::uint64_t per = s_.block / std::max(asz, bsz);
    if (!same) per = std::min(per, tmp_size / std::max<std::uint64_t>(lsz, 1));
    per = std::max<std::uint64_t>(per, 1);
    for (std::uint64_t r = 0; r < c.reps; ++r)
      for (std::uint64_t e = 0; e < c.count;) {
        const std::uint64_t k = std::min(per, c.count - e);
        const std::uint64_t ao = c.a_offset + r * c.a_step + e * asz, bo = c.b_offset + r * c.b_step + e * bsz;
        touch(c.a, ao, k * asz);
        touch(c.b, bo, k * bsz);
        const std::byte* pa = bytes_of(a, ao, k * asz, rbuf_, c.a_swap ? c.a_dtype : std::optional<dtype>());
        const std::byte* pb = bytes_of(b, bo, k * bsz, wbuf_, c.b_swap ? c.b_dtype : std::optional<dtype>());
        const std::byte* qa = pa;
        const std::byte* qb = pb;
        std::uint64_t isz = asz;
        if (!same) {
          cast_run(c.a_dtype, pa, c.logical, tmp_a_.get(), static_cast<std::size_t>(k));
          cast_run(c.b_dtype, pb, c.logical, tmp_b_.get(), static_cast<std::size_t>(k));
          qa = tmp_a_.get();
          qb = tmp_b_.get();
          isz = lsz;
        }
        if (std::memcmp(qa, qb, static_cast<std::size_t>(k * isz)) != 0) {
          std::uint64_t j = 0;
          while (std::memcmp(qa + j * isz, qb + j * isz, static_cast<std::size_t>(isz)) == 0) ++j;
          throw_error(errors::replica_mismatch, "tensor " + quote(s_.plan.tensors[c.tensor].name),
                      "replicas differ: " + detail::where_in(s_.plan.source_names, c.a, ao + j * asz) + " and " +
                          detail::where_in(s_.plan.source_names, c.b, bo + j * bsz) +
                          " (in the block of the tensor that starts at element " + to_string(c.first_index) + ")");
        }
        s_.compared.fetch_add(k);
        e += k;
      }
  }

  struct range {
    std::uint32_t src;
    std::uint64_t lo, hi;
  };

  exec_shared& s_;
  exec_buffer rbuf_, wbuf_, tmp_a_, tmp_b_;
  Sink* acc_sink_ = nullptr;
  std::uint64_t acc_off_ = 0, acc_len_ = 0;
  std::vector<range> touched_;
  std::uint64_t touched_bytes_ = 0;
};

}  // namespace detail

/// Runs `plan`: reads from `sources` (the checkpoint's byte sources, as planned) and writes into
/// `sinks` (one per destination; null for destinations this plan does not write, e.g. another
/// part's). Sinks get reserve(size) before and finish() after. Throws on the first error; what was
/// written by then is garbage to be discarded (uncommitted OutputFiles remove themselves).
inline exec_stats execute(const Plan& plan, std::span<const std::shared_ptr<const ByteSource>> sources,
                          std::span<Sink* const> sinks, const exec_options& opt = {}) {
  if (sources.size() != plan.source_sizes.size())
    throw_error(errors::source_mismatch, "plan", "planned for " + std::to_string(plan.source_sizes.size()) +
                                                     " byte sources, given " + std::to_string(sources.size()));
  for (std::size_t i = 0; i < sources.size(); ++i)
    if (!sources[i] || sources[i]->size() != plan.source_sizes[i])
      throw_error(errors::source_mismatch, "source " + quote(plan.source_names[i]),
                  "is missing or changed size since the plan was made");
  if (sinks.size() != plan.destination_names.size())
    throw_error(errors::sink_missing, "plan", "has " + std::to_string(plan.destination_names.size()) +
                                                  " destinations, given " + std::to_string(sinks.size()) + " sinks");
  for (const CopyOp& o : plan.ops)
    if (!sinks[o.dst])
      throw_error(errors::sink_missing, "destination " + quote(plan.destination_names[o.dst]), "has no sink");

  detail::exec_shared s(plan, sources, sinks, opt);
  // Threads and block size from the budget.
  unsigned threads = opt.threads ? opt.threads : std::max(1U, std::thread::hardware_concurrency());
  constexpr std::uint64_t min_block = std::uint64_t{64} << 10;
  constexpr std::uint64_t tmp_bytes = std::uint64_t{128} << 10;
  auto block_for = [&](unsigned t) -> std::uint64_t {
    const std::uint64_t per = opt.memory_budget / t;
    if (per <= tmp_bytes) return 0;
    return std::min((per - tmp_bytes) / 2, opt.max_block) / 4096 * 4096;
  };
  while (threads > 1 && block_for(threads) < min_block) --threads;
  s.block = block_for(threads);
  {  // no bigger than the largest operation needs
    std::uint64_t need = min_block;
    for (const CopyOp& o : plan.ops)
      need = std::max(need, o.elements() * std::max(itemsize(o.src_dtype), itemsize(o.dst_dtype)));
    for (const CompareOp& c : plan.checks)
      need = std::max(need, c.count * std::max(itemsize(c.a_dtype), itemsize(c.b_dtype)));
    if (need < s.block) s.block = std::max(min_block, (need + 4095) / 4096 * 4096);
  }
  if (s.block < min_block)
    throw_error(errors::budget_too_small, "memory budget of " + std::to_string(opt.memory_budget) +
                                              " bytes is below the minimum of " +
                                              std::to_string(2 * min_block + tmp_bytes) + " bytes");

  // Work items: replica checks first, then ordered lanes, then the copies in plan order.
  for (std::uint32_t k = 0; k < plan.checks.size(); ++k)
    s.items.push_back(detail::exec_item{detail::exec_item::kind::compare, k, k + 1, 0, 0});
  std::vector<int> lane_of(sinks.size(), -1);
  for (std::uint32_t k = 0; k < plan.ops.size(); ++k) {
    const std::uint32_t d = plan.ops[k].dst;
    if (!sinks[d]->ordered()) continue;
    if (lane_of[d] < 0) {
      lane_of[d] = static_cast<int>(s.lanes.size());
      s.lanes.emplace_back();
      s.items.push_back(detail::exec_item{detail::exec_item::kind::lane, static_cast<std::uint32_t>(s.lanes.size() - 1), 0, 0, 0});
    }
    s.lanes[static_cast<std::size_t>(lane_of[d])].push_back(k);
  }
  // Interleaved groups: operations of one destination with the same repetitions and destination
  // step whose runs (each below direct_write_min) sit side by side within one step. Their items
  // are rows of the whole group, each about one block of destination bytes.
  std::vector<std::uint32_t> group_of(plan.ops.size(), detail::exec_item::no_dst);
  {
    std::vector<std::uint32_t> cand;
    for (std::uint32_t k = 0; k < plan.ops.size(); ++k) {
      const CopyOp& o = plan.ops[k];
      const std::uint64_t run = o.count * itemsize(o.dst_dtype);
      if (o.reps > 1 && !sinks[o.dst]->ordered() && run < opt.direct_write_min && o.dst_step > run) cand.push_back(k);
    }
    std::sort(cand.begin(), cand.end(), [&](std::uint32_t a, std::uint32_t b) {
      const CopyOp &x = plan.ops[a], &y = plan.ops[b];
      return std::tie(x.dst, x.dst_step, x.reps, x.dst_offset) < std::tie(y.dst, y.dst_step, y.reps, y.dst_offset);
    });
    for (std::size_t i = 0; i < cand.size();) {
      const CopyOp& first = plan.ops[cand[i]];
      std::uint64_t end = first.dst_offset + first.count * itemsize(first.dst_dtype);
      std::size_t j = i + 1;
      for (; j < cand.size(); ++j) {
        const CopyOp& o = plan.ops[cand[j]];
        const std::uint64_t o_end = o.dst_offset + o.count * itemsize(o.dst_dtype);
        if (o.dst != first.dst || o.dst_step != first.dst_step || o.reps != first.reps || o.dst_offset < end ||
            o_end > first.dst_offset + first.dst_step)
          break;
        end = o_end;
      }
      if (j - i >= 2) {
        for (std::size_t g = i; g < j; ++g) group_of[cand[g]] = static_cast<std::uint32_t>(s.groups.size());
        s.groups.emplace_back(cand.begin() + static_cast<std::ptrdiff_t>(i), cand.begin() + static_cast<std::ptrdiff_t>(j));
      }
      i = j;
    }
  }
  std::vector<std::uint32_t> group_first;  // a group's items go where its first operation is
  for (const auto& g : s.groups) group_first.push_back(*std::min_element(g.begin(), g.end()));
  {
    std::uint32_t batch_begin = 0, batch_end = 0;
    std::uint64_t batch_bytes = 0;
    bool batch_converts = false;
    auto close_batch = [&] {
      if (batch_end > batch_begin)
        s.items.push_back(detail::exec_item{detail::exec_item::kind::ops, batch_begin, batch_end, 0, 0, plan.ops[batch_begin].dst,
                                            batch_converts});
      batch_bytes = 0;
      batch_converts = false;
    };
    for (std::uint32_t k = 0; k < plan.ops.size(); ++k) {
      const CopyOp& o = plan.ops[k];
      if (sinks[o.dst]->ordered()) continue;
      if (group_of[k] != detail::exec_item::no_dst) {  // the group's rows, where its first operation is
        const auto& g = s.groups[group_of[k]];
        if (group_first[group_of[k]] != k) continue;
        close_batch();
        batch_begin = batch_end = k + 1;
        std::uint64_t row = 0;
        bool converts = false;
        for (std::uint32_t m : g) {
          const CopyOp& p = plan.ops[m];
          row += p.count * std::max(itemsize(p.src_dtype), itemsize(p.dst_dtype));
          converts = converts || !p.plain();
        }
        const std::uint64_t rows = std::max<std::uint64_t>(1, s.block / row);
        for (std::uint64_t r = 0; r < o.reps; r += rows)
          s.items.push_back(detail::exec_item{detail::exec_item::kind::rows, group_of[k], 0, r, std::min(o.reps, r + rows), o.dst,
                                              converts});
        continue;
      }
      const std::uint64_t per_elem = std::max(itemsize(o.src_dtype), itemsize(o.dst_dtype));
      const std::uint64_t bytes = o.elements() * per_elem;
      if (bytes > s.block) {
        close_batch();
        batch_begin = batch_end = k + 1;
        const std::uint64_t step = std::max<std::uint64_t>(1, s.block / per_elem);
        for (std::uint64_t e = 0; e < o.elements(); e += step)
          s.items.push_back(detail::exec_item{detail::exec_item::kind::ops, k, k + 1, e, std::min(o.elements(), e + step), o.dst,
                                              !o.plain()});
        continue;
      }
      if (batch_bytes + bytes > s.block || batch_end != k || plan.ops[batch_begin].dst != o.dst) {
        close_batch();
        batch_begin = k;
      }
      batch_end = k + 1;
      batch_bytes += bytes;
      batch_converts = batch_converts || !o.plain();
    }
    close_batch();
  }

  for (std::size_t d = 0; d < sinks.size(); ++d)
    if (sinks[d]) sinks[d]->reserve(plan.destination_sizes[d]);
  if (opt.release_source_pages) detail::advise_sources(sources, opt.large_folios);

  s.total = plan.bytes();
  s.progress_step = std::max<std::uint64_t>(s.total / 1000, 1);
  threads = static_cast<unsigned>(std::min<std::size_t>(threads, std::max<std::size_t>(s.items.size(), 1)));
  std::vector<std::uint8_t> shared(sinks.size(), 0);
  for (std::size_t d = 0; d < sinks.size(); ++d) shared[d] = sinks[d] && sinks[d]->concurrent_writes() ? 1 : 0;
  s.scheduler.init(s.items, sinks.size(), std::move(shared));
  {
    std::vector<std::unique_ptr<detail::exec_worker>> workers;
    for (unsigned t = 0; t < threads; ++t) workers.push_back(std::make_unique<detail::exec_worker>(s));
    std::thread ahead;
    if (opt.release_source_pages && opt.large_folios) {
      std::vector<detail::file_extent> extents = detail::read_extents(plan, sources);
      // A few pages cached in a 2 MiB block the copy reads (a format's headers, read with pread)
      // would keep the whole block in 4 KiB folios: they are dropped first (docs/planner.md).
      for (const detail::file_extent& e : extents)
        (void)e.file->drop_sparse_blocks(e.lo, e.hi - e.lo, detail::large_folio_window, detail::large_folio_window / 4096 / 8);
      // A small job (a tensor read with read_tensor) is left to the faults' own 4 MiB readahead:
      // no thread is started for fewer bytes than two of the helper's steps.
      std::uint64_t reads = 0;
      for (const detail::file_extent& e : extents) reads += e.hi - e.lo;
      if (opt.read_ahead > 0 && reads >= 2 * detail::read_ahead_step)
        ahead = std::thread([&s, extents = std::move(extents)] { detail::read_ahead(s, extents); });
    }
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back([&, t] { workers[t]->run(); });
    workers[0]->run();
    for (auto& th : pool) th.join();
    s.copied.store(true);
    if (ahead.joinable()) ahead.join();
  }
  if (s.error) std::rethrow_exception(s.error);
  for (std::size_t d = 0; d < sinks.size(); ++d)
    if (sinks[d]) sinks[d]->finish();
  if (opt.progress) opt.progress(progress_event{progress_phase::copying, s.total, s.total, {}});

  exec_stats st;
  st.bytes_written = s.done.load();
  st.bytes_in_kernel = s.in_kernel.load();
  st.bytes_from_mapping = s.from_mapping.load();
  st.bytes_converted = s.converted.load();
  st.elements_compared = s.compared.load();
  st.bytes_read_ahead = s.read_ahead_bytes.load();
  st.ranges_released = s.ranges_released.load();
  st.buffer_bytes = s.ledger.peak();
  st.block_bytes = s.block;
  st.work_items = s.items.size();
  st.threads = threads;
  return st;
}

/// execute() with the sources of the checkpoint the plan was made from.
inline exec_stats execute(const Plan& plan, const ShardedCheckpoint& src, std::span<Sink* const> sinks,
                          const exec_options& opt = {}) {
  return execute(plan, std::span<const std::shared_ptr<const ByteSource>>(src.sources), sinks, opt);
}

}  // namespace statedict::inline v0
