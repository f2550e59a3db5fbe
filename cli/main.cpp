// statedict command-line tool: inspect, convert, verify (docs/cli.md).
//
// Exit codes: 0 success, 1 a check failed (verify), 2 bad input or usage. Errors are one line on
// stderr: "statedict: [statedict.<kind>.<id>] <where>: <what was expected>".
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <statedict/formats/transform_regex.hpp>
#include <statedict/statedict.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "args.hpp"
#include "progress.hpp"

namespace sd = statedict;

namespace {

constexpr const char* usage_text = R"(statedict: read, convert and verify ML checkpoints without PyTorch.

usage:
  statedict inspect PATH [--json] [--hash] [--with-optimizer] [--from FORMAT] [--io mmap|pread] [--quiet]
  statedict convert IN OUT [--to safetensors|hf|torch|dcp|olmo|colossalai|megatron|deepspeed|deepspeed-universal] [--from FORMAT] [--dtype F32|BF16|F16]
                    [--cast-integer-buffers] [--keep-dtype REGEX]... [--dequantize fp8-block|mxfp4|auto]
                    [--quantize fp8-block[:128]] [--quantize-match REGEX]... [--quantize-partial]
                    [--max-shard-size 5GB] [--world-size M] [--dcp-layout 2|1.13]
                    [--only NAME_PREFIX]... [--drop REGEX]... [--strip-prefix P]... [--add-prefix P]...
                    [--rename FROM=TO]... [--rename-regex REGEX=REPLACEMENT]... [--map NAMES.json]...
                    [--with-optimizer] [--threads N] [--memory-budget 256MiB]
                    [--part k/K | --part index] [--check-replicas] [--io mmap|pread] [--write direct|cached]
                    [--keep-class MODULE.CLASS]... [--tp N] [--pp M] [--vpp V] [--zero-stage 1|2|3] [--quiet]
                    [--fresh-optimizer adamw:lr=1e-4,betas=0.9/0.999,eps=1e-8,weight_decay=0.01]
                    [--frozen REGEX]... [--buffer REGEX]...
  statedict verify A B [--rtol R] [--atol A] [--with-optimizer] [--from FORMAT] [--io mmap|pread]
  statedict --version
Megatron-LM (all commands): [--megatron-rule PATTERN=KIND]... [--true-vocab-size N]
DeepSpeed (all commands): [--frozen-from-module] (stage 1: frozen parameters from module)

PATH, IN, A, B: a .safetensors file, a torch.save file (.pt, .bin, any name), a Hugging Face
sharded directory or index, a torch.distributed.checkpoint directory, a DeepSpeed ZeRO 1/2/3
checkpoint, an OLMo/FSDP sharded checkpoint, ShardedTensor rank files, an OLMo mapped safetensors
file, a ColossalAI checkpoint, or fairscale FSDP rank files (fairseq, metaseq), or a
Megatron-LM checkpoint (legacy mp_rank_* files or torch_dist). The format is detected
from the content (--from FORMAT reads it as that format). The name options of convert apply in
the order given. Pickled objects are read as data, never run; convert writes each object whose
class torch.load(weights_only=True) refuses as its data (--keep-class writes that class as itself,
for input you trust). Progress goes to stderr: one line redrawn on a terminal, a few plain lines
otherwise, nothing with --quiet (which also leaves out convert's summary). Exit codes: 0 success, 1 verify found a difference, 2 bad input or usage.
See docs/cli.md.
)";

/// "256MiB", "1GB", "4096": binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units.
std::uint64_t parse_bytes(const std::string& text, const std::string& option) {
  std::size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  if (i == 0) sd::throw_error(cli::errors::bad_value, option, sd::quote(text) + " is not a size like 256MiB");
  std::uint64_t n = 0;
  try {
    n = std::stoull(text.substr(0, i));
  } catch (...) {
    sd::throw_error(cli::errors::bad_value, option, sd::quote(text) + " is too large");
  }
  std::string unit = text.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  struct u {
    const char* name;
    std::uint64_t mul;
  };
  constexpr u units[] = {{"", 1},           {"B", 1},          {"KIB", 1ULL << 10}, {"MIB", 1ULL << 20}, {"GIB", 1ULL << 30},
                         {"TIB", 1ULL << 40}, {"KB", 1000ULL}, {"MB", 1000000ULL},  {"GB", 1000000000ULL}, {"TB", 1000000000000ULL}};
  for (const auto& x : units)
    if (unit == x.name) return sd::checked_mul(n, x.mul, option);
  sd::throw_error(cli::errors::bad_value, option, "unknown unit in " + sd::quote(text) + " (use KiB, MiB, GiB, KB, MB, GB)");
}

std::uint64_t parse_count(const std::string& text, const std::string& option, std::uint64_t lo, std::uint64_t hi) {
  std::uint64_t n = 0;
  std::size_t used = 0;
  try {
    n = std::stoull(text, &used);
  } catch (...) {
    used = 0;
  }
  if (used == 0 || used != text.size() || n < lo || n > hi)
    sd::throw_error(cli::errors::bad_value, option,
                    sd::quote(text) + " is not a whole number from " + std::to_string(lo) + " to " + std::to_string(hi));
  return n;
}

sd::read_mode parse_io(const cli::Args& a) {
  const auto v = a.value("--io");
  if (!v || *v == "mmap") return sd::read_mode::mmap;
  if (*v == "pread") return sd::read_mode::pread;
  a.fail(cli::errors::bad_value, "--io takes mmap or pread, not " + sd::quote(*v));
}

std::optional<sd::dtype> parse_dtype(const cli::Args& a) {
  const auto v = a.value("--dtype");
  if (!v) return std::nullopt;
  const auto t = sd::dtype_from_name(*v);
  if (!t || (*t != sd::dtype::F32 && *t != sd::dtype::BF16 && *t != sd::dtype::F16))
    a.fail(cli::errors::bad_value, "--dtype takes F32, BF16 or F16, not " + sd::quote(*v));
  return t;
}

/// The command's progress display (progress.hpp); main() erases its line before an error.
std::unique_ptr<cli::progress_renderer> progress;

/// Sets up `progress` on stderr: nothing with --quiet, a line redrawn in place on a terminal,
/// plain lines otherwise. `copying` names the copy phase ("hashing" for inspect --hash).
cli::progress_renderer& start_progress(const cli::Args& a, std::string copying) {
  cli::progress_renderer::settings s;
  s.copying = std::move(copying);
  if (a.flag("--quiet")) {
    s.mode = cli::progress_mode::off;
  } else if (::isatty(STDERR_FILENO)) {
    s.mode = cli::progress_mode::terminal;
    winsize ws{};
    if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 20) s.width = ws.ws_col;
  } else {
    s.mode = cli::progress_mode::lines;
  }
  const auto start = std::chrono::steady_clock::now();
  progress = std::make_unique<cli::progress_renderer>(
      std::move(s),
      [](std::string_view text) {
        std::fwrite(text.data(), 1, text.size(), stderr);
        std::fflush(stderr);
      },
      [start] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); });
  return *progress;
}

sd::exec_options exec_options_from(const cli::Args& a) {
  sd::exec_options e;
  const unsigned hw = std::max(1U, std::thread::hardware_concurrency());
  e.threads = a.value("--threads") ? static_cast<unsigned>(parse_count(*a.value("--threads"), "--threads", 1, 256)) : hw;
  if (auto b = a.value("--memory-budget")) e.memory_budget = parse_bytes(*b, "--memory-budget");
  if (progress && progress->mode() != cli::progress_mode::off)
    e.progress = [r = progress.get()](const sd::progress_event& ev) { r->update(ev); };
  return e;
}

/// The Megatron-LM options every command takes (docs/formats/megatron.md).
const std::vector<cli::OptionSpec> megatron_options{{"--megatron-rule", true, true}, {"--true-vocab-size", true},
                                                    {"--frozen-from-module", false}};

std::vector<sd::megatron::rule> megatron_rules(const cli::Args& a) {
  std::vector<sd::megatron::rule> r;
  for (const auto& v : a.values("--megatron-rule")) r.push_back(sd::megatron::parse_rule(v));
  return r;
}

std::optional<std::uint64_t> true_vocab_size(const cli::Args& a) {
  const auto v = a.value("--true-vocab-size");
  return v ? std::optional<std::uint64_t>(parse_count(*v, "--true-vocab-size", 1, std::uint64_t{1} << 40)) : std::nullopt;
}

/// Opens an input. --megatron-rule applies to a Megatron-LM input, --true-vocab-size cuts its
/// vocabulary; both are refused for any other input, unless the output is Megatron-LM
/// (`megatron_output`: there --true-vocab-size re-pads the vocabulary instead).
sd::formats::Opened open_input(const std::string& path, const cli::Args& a, std::optional<sd::dtype> dtype = std::nullopt,
                               bool megatron_output = false, sd::formats::open_options o = {}) {
  o.mode = parse_io(a);
  o.with_optimizer = a.flag("--with-optimizer");
  o.check_replicas = a.flag("--check-replicas");
  o.dtype = dtype;
  o.cast_integer_origin = a.flag("--cast-integer-buffers");
  if (auto f = a.value("--from")) o.format = *f;
  const bool megatron = a.flag("--megatron-rule") || (!megatron_output && a.flag("--true-vocab-size"));
  if (megatron) {
    auto& m = o.settings.set<sd::megatron::options>();
    m.rules = megatron_rules(a);
    if (!megatron_output) m.true_vocab_size = true_vocab_size(a);
  }
  if (a.flag("--frozen-from-module")) o.settings.set<sd::deepspeed::options>().frozen_from_module = true;
  auto opened = sd::formats::open(path, o);
  if (a.flag("--frozen-from-module") && opened.format->name() != "deepspeed")
    a.fail(cli::errors::bad_option, "--frozen-from-module applies to DeepSpeed checkpoints; " + sd::quote(path) + " is " +
                                        std::string(opened.format->title()));
  if (megatron && !megatron_output && opened.format->name() != "megatron")
    a.fail(cli::errors::bad_option, "--megatron-rule and --true-vocab-size apply to Megatron-LM checkpoints; " + sd::quote(path) + " is " +
                                        std::string(opened.format->title()));
  return opened;
}

/// Options for a Command's spec plus the Megatron-LM ones.
std::vector<cli::OptionSpec> with_megatron(std::vector<cli::OptionSpec> spec) {
  spec.insert(spec.end(), megatron_options.begin(), megatron_options.end());
  return spec;
}

std::string shape_str(const sd::shape_t& s) { return sd::to_string(s); }

/// Keeps `v` until the process exits instead of destroying it: the command returns to exit right
/// after, and the kernel takes back the whole heap at once, while freeing the description of a
/// checkpoint of 10,000 tensors block by block was ~10% of `inspect`'s time (as compilers skip
/// freeing their ASTs at exit). Held through a global pointer, so leak checkers see it reachable.
template <class T>
void keep_until_exit(T&& v) {
  static auto* kept = new std::vector<std::shared_ptr<void>>;  // never freed, on purpose
  kept->push_back(std::make_shared<std::decay_t<T>>(std::forward<T>(v)));
}

/// Prepares the heap for a command that builds a description out of tens of thousands of small
/// objects and exits right after (inspect). On glibc, by default, every vector past 128 KiB gets
/// its own fresh mapping, each growth maps a new one and unmaps the old, and every 4 KiB page of
/// all of them is faulted in: about 7,000 page faults and half of `inspect`'s time in the kernel
/// for a checkpoint of 10,000 tensors. Here the heap grows once by 64 MiB (M_TOP_PAD), large
/// blocks come from it and go back to it (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), and the range is
/// marked for transparent huge pages, which is what GLIBC_TUNABLES=glibc.malloc.hugetlb=1 does for
/// a process that sets it before it starts. Address space only: untouched pages cost nothing.
/// Not done where malloc is not glibc's (musl, sanitizers), nor for convert/verify, whose large
/// buffers should go back to the system when freed.
void heap_for_many_small_objects() {
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define STATEDICT_CLI_FOREIGN_MALLOC 1
#endif
#endif
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && !defined(STATEDICT_CLI_FOREIGN_MALLOC)
  constexpr std::size_t mib = std::size_t{1} << 20, pad = 64 * mib, huge = 2 * mib;
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(256 * mib)) != 1 || mallopt(M_TRIM_THRESHOLD, static_cast<int>(512 * mib)) != 1 ||
      mallopt(M_TOP_PAD, static_cast<int>(pad)) != 1)
    return;
  // A block larger than the heap's free top makes malloc extend the heap by the block + pad now.
  void* probe = std::malloc(mib);
  if (probe == nullptr) return;
  const auto begin = (reinterpret_cast<std::uintptr_t>(probe) + huge - 1) & ~(huge - 1);
  const auto end = reinterpret_cast<std::uintptr_t>(::sbrk(0)) & ~(huge - 1);
  std::free(probe);
  // The probe lies in the brk heap only when malloc is glibc's main arena; otherwise do nothing.
  if (begin < end && end - begin <= 2 * pad) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

// ---------------------------------------------------------------------------------------------

/// Appends `s` as a JSON string: printable ASCII without quotes or backslashes (nearly every
/// tensor name) as is, anything else through nlohmann's escaping (invalid UTF-8 is an error, as
/// in dump()). Building a json value and a serializer per name was ~60,000 of the 690,000
/// allocations of `inspect --json` on a file of 10,000 tensors.
void append_json_string(std::string& o, const std::string& s) {
  unsigned escape = 0;  // no early exit: the loop vectorizes
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    escape |= static_cast<unsigned>((c < 0x20) | (c > 0x7e) | (c == '"') | (c == '\\'));
  }
  if (escape != 0) {
    o += nlohmann::json(s).dump();
    return;
  }
  o += '"';
  o += s;
  o += '"';
}
std::string json_string(const std::string& s) {
  std::string o;
  append_json_string(o, s);
  return o;
}

int cmd_inspect(const std::vector<std::string>& argv) {
  cli::Args a(argv,
              with_megatron({{"--json", false}, {"--hash", false}, {"--with-optimizer", false}, {"--from", true}, {"--io", true},
                             {"--threads", true}, {"--memory-budget", true}, {"--quiet", false}}),
              1, 1, "inspect");
  heap_for_many_small_objects();
  auto opened = open_input(a.positional()[0], a);
  const auto ties = opened.checkpoint.skeleton.is_null() ? std::vector<sd::formats::Tie>{}
                                                         : sd::formats::tied_names(opened.checkpoint.skeleton);
  auto values = opened.checkpoint.skeleton.is_null() ? std::vector<std::pair<std::string, sd::Value>>{}
                                                           : sd::skeleton_values(opened.checkpoint.skeleton);
  sd::ShardedCheckpoint ck = sd::formats::expand_ties(std::move(opened.checkpoint), ties);
  std::vector<std::pair<std::string, std::string>> hashes;
  if (a.flag("--hash")) {
    auto& shown = start_progress(a, "hashing");
    {
      const cli::progress_ticker ticker(shown);
      hashes = sd::sha256_tensors(ck, exec_options_from(a));
    }
    shown.clear();
  }

  if (a.flag("--json")) {
    // Written piece by piece, in the layout of nlohmann's dump(1): an ordered_json object searches
    // its keys linearly on every insert, quadratic for a checkpoint of 10,000 tensors.
    std::string o;
    o.reserve(ck.tensors.size() * 112 + 256);
    o += "{\n \"format\": " + json_string(ck.format) + ",\n \"rule\": " + json_string(opened.rule) + ",\n \"tensors\": {";
    using namespace std::string_view_literals;  // lengths known at compile time: no strlen per piece
    for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
      const auto& t = ck.tensors[i];
      o += i ? ",\n  "sv : "\n  "sv;
      append_json_string(o, t.name);
      o += ": {\n   \"dtype\": \""sv;
      o += sd::name(t.dtype);
      o += "\",\n   \"shape\": ["sv;
      for (std::size_t d = 0; d < t.shape.size(); ++d) {
        if (d) o += ", "sv;
        char digits[24];
        o.append(digits, static_cast<std::size_t>(std::to_chars(digits, digits + sizeof digits, t.shape[d]).ptr - digits));
      }
      o += "]"sv;
      if (t.converted_from) {
        o += ",\n   \"converted_from\": \""sv;
        o += sd::name(*t.converted_from);
        o += "\""sv;
      }
      if (!hashes.empty()) o += ",\n   \"sha256\": \"" + hashes[i].second + "\"";
      o += "\n  }"sv;
    }
    o += ck.tensors.empty() ? "}" : "\n }";
    auto object = [&o](const char* key, const auto& pairs, auto&& value) {
      o += ",\n \"";
      o += key;
      o += "\": {";
      bool first = true;
      for (const auto& p : pairs) {
        o += first ? "\n  " : ",\n  ";
        first = false;
        append_json_string(o, p.first);
        o += ": ";
        o += value(p.second);
      }
      o += first ? "}" : "\n }";
    };
    object("values", values, [](const sd::Value& v) { return sd::value_json(v).dump(); });
    std::vector<std::pair<std::string, std::string>> aliases;
    aliases.reserve(ties.size());
    for (const auto& t : ties) aliases.emplace_back(t.name, t.target);
    object("aliases", aliases, [](const std::string& v) { return json_string(v); });
    if (!ck.metadata.empty()) object("metadata", ck.metadata, [](const std::string& v) { return json_string(v); });
    o += "\n}\n";
    std::cout << o;
    keep_until_exit(std::move(ck));
    keep_until_exit(std::move(values));
    return 0;
  }
  // expand_ties appends the tied names after the stored tensors.
  const std::size_t stored = ck.tensors.size() - ties.size();
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < stored; ++i) bytes += sd::byte_size(ck.tensors[i].shape, sd::itemsize(ck.tensors[i].dtype));
  std::cout << "format:  " << ck.format << "  (" << opened.rule << ")\n";
  std::cout << "tensors: " << stored << " stored";
  if (!ties.empty()) std::cout << " + " << ties.size() << " tied";
  std::cout << ", " << bytes << " bytes\n";
  std::size_t wname = 4, wdtype = 5;
  for (const auto& t : ck.tensors) {
    wname = std::max(wname, t.name.size());
    wdtype = std::max(wdtype, sd::name(t.dtype).size());
  }
  wname = std::min<std::size_t>(wname, 80);
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
    const auto& t = ck.tensors[i];
    std::string line = "  " + t.name;
    line.resize(std::max(line.size(), wname + 4), ' ');
    std::string dt(sd::name(t.dtype));
    dt.resize(wdtype + 2, ' ');
    line += dt + shape_str(t.shape);
    if (t.converted_from) line += "  (stored as " + std::string(sd::name(*t.converted_from)) + ")";
    if (!hashes.empty()) line += "  " + hashes[i].second;
    std::cout << line << "\n";
  }
  if (!ties.empty()) {
    std::cout << "tied:\n";
    for (const auto& t : ties) std::cout << "  " << t.name << " -> " << t.target << (t.view ? " (view)" : "") << "\n";
  }
  if (!values.empty()) {
    std::cout << "values: " << values.size() << "\n";
    for (const auto& [n, v] : values)
      std::cout << "  " << n << " = " << (v.is_object() ? sd::value_repr(v) : sd::value_json(v).dump()) << "\n";
  }
  if (!ck.metadata.empty()) {
    std::cout << "metadata:\n";
    for (const auto& [k, v] : ck.metadata) std::cout << "  " << k << " = " << (v.size() > 120 ? v.substr(0, 117) + "..." : v) << "\n";
  }
  keep_until_exit(std::move(ck));
  keep_until_exit(std::move(values));
  return 0;
}

/// "FROM=TO" split at its first '=' (a name may not contain one; a regex replacement may).
std::pair<std::string, std::string> split_pair(const std::string& text, const cli::Args& a, const char* option) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) a.fail(cli::errors::bad_value, std::string(option) + " takes FROM=TO, not " + sd::quote(text));
  return {text.substr(0, eq), text.substr(eq + 1)};
}

/// A JSON object {old name: new name} read from `path` (at most 64 MiB).
std::map<std::string, std::string, std::less<>> read_name_map(const std::string& path) {
  const auto f = sd::InputFile::open(path, sd::read_mode::pread);
  if (f->size() > (std::uint64_t{64} << 20))
    sd::throw_error(cli::errors::bad_value, "--map " + sd::quote(path), "is larger than 64 MiB");
  std::string text(static_cast<std::size_t>(f->size()), '\0');
  f->read(0, std::as_writable_bytes(std::span<char>(text.data(), text.size())));
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) sd::throw_error(cli::errors::bad_value, "--map " + sd::quote(path), "is not a JSON object {\"old name\": \"new name\"}");
  std::map<std::string, std::string, std::less<>> m;
  for (const auto& [k, v] : j.items()) {
    if (!v.is_string())
      sd::throw_error(cli::errors::bad_value, "--map " + sd::quote(path), "maps " + sd::quote(k) + " to a " + v.type_name() + ", not a name");
    m.emplace(k, v.get<std::string>());
  }
  return m;
}

/// The name options of convert (--only, --drop, --strip-prefix, --add-prefix, --rename,
/// --rename-regex, --map), as transforms applied in command-line order. Regular expressions and
/// maps are read here, before the input.
std::vector<std::function<sd::ShardedCheckpoint(const sd::ShardedCheckpoint&)>> name_transforms(const cli::Args& a) {
  namespace f = sd::formats;
  std::vector<std::function<sd::ShardedCheckpoint(const sd::ShardedCheckpoint&)>> out;
  std::vector<std::string> only;  // consecutive --only prefixes select together
  auto flush_only = [&] {
    if (only.empty()) return;
    out.emplace_back([p = only](const sd::ShardedCheckpoint& ck) { return f::select(ck, p); });
    only.clear();
  };
  for (const auto& [opt, value] : a.sequence()) {
    if (opt == "--only") {
      only.push_back(value);
      continue;
    }
    flush_only();
    auto rename = [&](f::name_map m) { out.emplace_back([m = std::move(m)](const sd::ShardedCheckpoint& ck) { return f::rename(ck, m); }); };
    if (opt == "--drop") {
      out.emplace_back([pred = f::regex_matches(value)](const sd::ShardedCheckpoint& ck) { return f::drop(ck, pred); });
    } else if (opt == "--strip-prefix") {
      rename(f::strip_prefix(value));
    } else if (opt == "--add-prefix") {
      rename(f::add_prefix(value));
    } else if (opt == "--rename") {
      auto [from, to] = split_pair(value, a, "--rename");
      rename(f::rename_prefix(from, to));
    } else if (opt == "--rename-regex") {
      auto [from, to] = split_pair(value, a, "--rename-regex");
      rename(f::rename_regex(from, to));
    } else if (opt == "--map") {
      rename(f::rename_map(read_name_map(value)));
    }
  }
  flush_only();
  return out;
}

/// The small files of a Hugging Face folder that describe the model rather than hold weights.
constexpr const char* hf_side_files[] = {"config.json",           "generation_config.json", "tokenizer.json",  "tokenizer_config.json",
                                         "special_tokens_map.json", "tokenizer.model",       "vocab.json",      "merges.txt",
                                         "added_tokens.json",     "chat_template.jinja"};

/// After `convert --dequantize` (or `--quantize`) of a folder into a Hugging Face folder: the
/// input's config.json without its quantization_config (with `quant`, this one instead), its
/// dtype entry set to `dtype` when given, and its other small files as they are, each written
/// atomically. Files above 64 MiB are left out.
void copy_hf_side_files(const std::filesystem::path& in, const std::filesystem::path& out, std::optional<sd::dtype> dtype,
                        const nlohmann::ordered_json& quant = nullptr) {
  for (const char* name : hf_side_files) {
    std::error_code ec;
    const auto from = in / name;
    if (!std::filesystem::is_regular_file(from, ec)) continue;
    const auto f = sd::InputFile::open(from, sd::read_mode::pread);
    if (f->size() > (std::uint64_t{64} << 20)) {
      std::fprintf(stderr, "statedict: %s is larger than 64 MiB: not copied\n", sd::quote(from.string()).c_str());
      continue;
    }
    std::string text(static_cast<std::size_t>(f->size()), '\0');
    f->read(0, std::as_writable_bytes(std::span<char>(text.data(), text.size())));
    if (std::string_view(name) == "config.json") {
      auto j = nlohmann::ordered_json::parse(text, nullptr, false);
      if (!j.is_object()) {
        std::fprintf(stderr, "statedict: %s is not a JSON object: not copied\n", sd::quote(from.string()).c_str());
        continue;
      }
      j.erase("quantization_config");
      if (!quant.is_null()) j["quantization_config"] = quant;
      if (dtype)
        for (const char* key : {"torch_dtype", "dtype"})
          if (j.contains(key)) j[key] = std::string(sd::info(*dtype).torch_name);
      text = j.dump(2) + "\n";
    }
    auto o = sd::OutputFile::create(out / name);
    o.write(text);
    o.commit();
  }
}

/// `--quantize fp8-block[:B]`: block B x B (128 by default).
std::uint64_t parse_quantize(const cli::Args& a, const std::string& v) {
  constexpr std::string_view scheme = "fp8-block";
  if (v == scheme) return 128;
  if (v.size() > scheme.size() + 1 && v.compare(0, scheme.size() + 1, "fp8-block:") == 0)
    return parse_count(v.substr(scheme.size() + 1), "--quantize fp8-block:", 1, 1U << 16);
  a.fail(cli::errors::bad_value, "--quantize takes fp8-block or fp8-block:BLOCK (e.g. fp8-block:128), not " + sd::quote(v));
}

/// The `quantization_config` of a block-FP8 Hugging Face folder (transformers' FineGrainedFP8,
/// DeepSeek-V3's keys): every 2-D `X.weight` left unquantized is named in modules_to_not_convert,
/// as an anchored regular expression (transformers matches its entries as prefixes).
nlohmann::ordered_json fp8_quantization_config(const sd::ShardedCheckpoint& ck, std::uint64_t block) {
  nlohmann::ordered_json q = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {block, block}}};
  auto skip = nlohmann::ordered_json::array();
  constexpr std::string_view suffix = ".weight";
  for (const auto& t : ck.tensors) {
    const std::string_view n = t.name;
    if (t.shape.size() < 2 || t.dtype == sd::dtype::F8_E4M3 || n.size() <= suffix.size() || n.substr(n.size() - suffix.size()) != suffix) continue;
    std::string re;
    for (const char c : n.substr(0, n.size() - suffix.size())) {
      if (std::string_view(".^$*+?()[]{}|\\").find(c) != std::string_view::npos) re += '\\';
      re += c;
    }
    skip.push_back(re + "$");
  }
  q["modules_to_not_convert"] = skip;
  return q;
}

int cmd_convert(const std::vector<std::string>& argv) {
  cli::Args a(argv,
              with_megatron({{"--to", true}, {"--from", true}, {"--dtype", true}, {"--cast-integer-buffers", false}, {"--keep-dtype", true, true},
               {"--dequantize", true}, {"--quantize", true}, {"--quantize-match", true, true}, {"--quantize-partial", false},
               {"--max-shard-size", true},
               {"--world-size", true}, {"--only", true, true}, {"--drop", true, true}, {"--strip-prefix", true, true},
               {"--add-prefix", true, true}, {"--rename", true, true}, {"--rename-regex", true, true}, {"--map", true, true},
               {"--with-optimizer", false}, {"--threads", true}, {"--memory-budget", true}, {"--part", true},
               {"--check-replicas", false}, {"--io", true}, {"--write", true}, {"--dcp-layout", true},
               {"--keep-class", true, true}, {"--tp", true}, {"--pp", true}, {"--vpp", true}, {"--zero-stage", true},
               {"--fresh-optimizer", true}, {"--frozen", true, true}, {"--buffer", true, true},
               {"--quiet", false}}),
              2, 2, "convert");
  const std::string in = a.positional()[0], out = a.positional()[1];
  const auto dtype = parse_dtype(a);
  // --dequantize and --keep-dtype: how the input is read (formats::dequantize, cast_options::keep).
  sd::formats::open_options how;
  if (auto v = a.value("--dequantize")) {
    sd::formats::dequantize_options d;
    if (*v == "fp8-block") d.scheme = sd::formats::quant_scheme::fp8_block;
    else if (*v == "mxfp4") d.scheme = sd::formats::quant_scheme::mxfp4;
    else if (*v != "auto") a.fail(cli::errors::bad_value, "--dequantize takes fp8-block, mxfp4 or auto, not " + sd::quote(*v));
    if (!dtype) a.fail(cli::errors::bad_option, "--dequantize needs --dtype BF16, F16 or F32: the dtype the dequantized tensors are written in");
    how.dequantize = d;
  }
  std::optional<std::uint64_t> quant_block;
  if (auto v = a.value("--quantize")) {
    if (how.dequantize) a.fail(cli::errors::bad_option, "--quantize and --dequantize do not go together");
    sd::formats::quantize_options q;
    quant_block = parse_quantize(a, *v);
    q.block_rows = q.block_cols = *quant_block;
    q.partial_blocks = a.flag("--quantize-partial");
    std::vector<std::function<bool(std::string_view)>> match, keep;
    for (const auto& r : a.values("--quantize-match")) match.push_back(sd::formats::regex_matches(r));
    for (const auto& r : a.values("--keep-dtype")) keep.push_back(sd::formats::regex_matches(r));
    auto any = [](const std::vector<std::function<bool(std::string_view)>>& preds, std::string_view n) {
      return std::any_of(preds.begin(), preds.end(), [&](const auto& p) { return p(n); });
    };
    if (!match.empty() || !keep.empty())
      q.select = [match = std::move(match), keep = std::move(keep), any](std::string_view n) {
        return !any(keep, n) && (match.empty() ? sd::formats::default_quantized(n) : any(match, n));
      };
    how.quantize = q;
  } else if (a.flag("--quantize-match") || a.flag("--quantize-partial")) {
    a.fail(cli::errors::bad_option, "--quantize-match and --quantize-partial apply with --quantize");
  }
  if (const auto keep = a.values("--keep-dtype"); !keep.empty()) {
    if (!dtype && !how.quantize) a.fail(cli::errors::bad_option, "--keep-dtype applies with --dtype or --quantize");
    std::vector<std::function<bool(std::string_view)>> preds;
    for (const auto& r : keep) preds.push_back(sd::formats::regex_matches(r));
    how.keep_dtype = [preds = std::move(preds)](std::string_view n) {
      return std::any_of(preds.begin(), preds.end(), [&](const auto& p) { return p(n); });
    };
  }

  auto& shown = start_progress(a, "copying");
  sd::formats::save_options w;
  w.format = a.value("--to").value_or("");
  w.exec = exec_options_from(a);
  if (auto v = a.value("--write")) {
    if (*v == "cached") w.exec.direct_io = false;
    else if (*v != "direct") a.fail(cli::errors::bad_value, "--write takes direct or cached, not " + sd::quote(*v));
  }
  w.plan.check_replicas = a.flag("--check-replicas");
  if (auto m = a.value("--max-shard-size")) w.max_shard_size = sd::hf::parse_max_shard_size(*m);
  if (auto m = a.value("--world-size")) w.world_size = static_cast<std::uint32_t>(parse_count(*m, "--world-size", 1, 1U << 16));
  if (auto p = a.value("--part")) {
    if (*p == "index") w.index_only = true;
    else w.part = sd::parse_part(*p);
  }
  for (const auto& c : a.values("--keep-class")) {
    if (c.empty() || c.find('.') == std::string::npos || c.front() == '.' || c.back() == '.')
      a.fail(cli::errors::bad_value, "--keep-class takes a qualified class name such as argparse.Namespace, not " + sd::quote(c));
    w.keep_classes.push_back(c);
  }
  // Megatron-LM output: --tp / --pp / --vpp ask for it; --true-vocab-size then re-pads (not cuts).
  const bool sizes = a.flag("--tp") || a.flag("--pp") || a.flag("--vpp");
  if (sizes) {
    auto& m = w.settings.set<sd::megatron::write_options>();
    auto size = [&](const char* opt) -> std::optional<std::uint64_t> {
      const auto v = a.value(opt);
      return v ? std::optional<std::uint64_t>(parse_count(*v, opt, 1, 1U << 16)) : std::nullopt;
    };
    m.tp = size("--tp");
    m.pp = size("--pp");
    m.vpp = size("--vpp");
  }
  // The output format, its options and the name options are checked before the input is read.
  const auto format = sd::formats::choose_output(out, w);
  const bool to_megatron = format->name() == "megatron";
  if (sizes && !to_megatron) a.fail(cli::errors::bad_option, "--tp, --pp and --vpp apply to Megatron-LM output (--to megatron)");
  if (to_megatron) {
    auto& m = w.settings.set<sd::megatron::write_options>();
    m.rules = megatron_rules(a);
    m.true_vocab_size = true_vocab_size(a);
    w.keep_classes.emplace_back("argparse.Namespace");  // Megatron's loader reads args by attribute
  }
  if (auto z = a.value("--zero-stage")) {
    if (format->name() != "deepspeed") a.fail(cli::errors::bad_option, "--zero-stage applies to DeepSpeed output (--to deepspeed)");
    w.settings.set<sd::deepspeed::write_options>().zero_stage = static_cast<int>(parse_count(*z, "--zero-stage", 1, 3));
  }
  // A weights-only input written for the DeepSpeed engine with a freshly constructed optimizer.
  if (auto f = a.value("--fresh-optimizer")) {
    if (format->name() != "deepspeed")
      a.fail(cli::errors::bad_option, "--fresh-optimizer applies to DeepSpeed output (--to deepspeed)");
    auto fresh = sd::deepspeed::parse_fresh_optimizer(*f);
    fresh.frozen = a.values("--frozen");
    fresh.buffers = a.values("--buffer");
    w.settings.set<sd::deepspeed::write_options>().fresh = std::move(fresh);
  } else if (!a.values("--frozen").empty() || !a.values("--buffer").empty()) {
    a.fail(cli::errors::bad_option, "--frozen and --buffer say which tensors a fresh optimizer leaves out: they apply with --fresh-optimizer");
  }
  if (auto l = a.value("--dcp-layout")) {
    if (format->name() != "dcp") a.fail(cli::errors::bad_value, "--dcp-layout applies to DCP output (--to dcp) only");
    if (*l == "2" || *l == "2.x") w.settings.set<sd::dcp::write_options>().classes = sd::dcp::class_names::torch_2;
    else if (*l == "1.13") w.settings.set<sd::dcp::write_options>().classes = sd::dcp::class_names::torch_1_13;
    else a.fail(cli::errors::bad_value, "--dcp-layout takes 2 (PyTorch 2.x, the default) or 1.13, not " + sd::quote(*l));
  }
  const auto transforms = name_transforms(a);

  const auto t0 = std::chrono::steady_clock::now();
  const bool dequantizing = how.dequantize.has_value();
  std::optional<cli::progress_ticker> ticker(std::in_place, shown);
  shown.update({sd::progress_phase::reading, 0, 0, in});
  auto opened = open_input(in, a, dtype, to_megatron, std::move(how));
  sd::ShardedCheckpoint ck = std::move(opened.checkpoint);
  for (const auto& t : transforms) ck = t(ck);
  // Objects are written as their data (classes torch's weights_only list has, and --keep-class
  // ones, as themselves): one line per class says what was done.
  for (const auto& note : sd::formats::objects_as_data(ck, w.keep_classes))
    shown.message("statedict: " + note.describe() + (note.instances ? " (--keep-class " + note.cls + " writes it as itself)" : "") + "\n");

  std::uint64_t bytes = 0;
  for (const auto& t : ck.tensors) bytes += sd::byte_size(t.shape, sd::itemsize(t.dtype));
  // OUT's folder is made like `mkdir -p` (only once the input is known good).
  if (const auto parent = std::filesystem::path(out).parent_path(); !parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) sd::throw_error(sd::errors::open_failed, "folder " + sd::quote(parent.string()), "cannot create: " + ec.message());
  }
  const auto files = sd::formats::save(ck, out, w);
  ticker.reset();
  shown.clear();
  if (dequantizing && format->name() == "hf" && !w.part && std::filesystem::is_directory(in)) copy_hf_side_files(in, out, dtype);
  if (quant_block && format->name() == "hf" && !w.part) {
    if (std::filesystem::is_regular_file(std::filesystem::path(in) / "config.json"))
      copy_hf_side_files(in, out, dtype, fp8_quantization_config(ck, *quant_block));
    else
      std::fprintf(stderr, "statedict: %s has no config.json: the output has none, so no quantization_config either\n", sd::quote(in).c_str());
  }
  std::string what = std::string(format->title()) + " checkpoint";
  if (w.index_only) what = "the index of a " + what;
  if (w.world_size) what += " for " + std::to_string(*w.world_size) + " rank" + (*w.world_size == 1 ? "" : "s");
  if (to_megatron) {
    const auto& m = w.settings.get<sd::megatron::write_options>();
    what += " for TP " + std::to_string(m.tp.value_or(1)) + " x PP " + std::to_string(m.pp.value_or(1));
    if (m.vpp) what += " x virtual PP " + std::to_string(*m.vpp);
  }
  if (files.size() > 1) what += " (" + std::to_string(files.size()) + " files)";
  if (w.part) what += " (part " + std::to_string(w.part->index) + "/" + std::to_string(w.part->count) + ")";
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!a.flag("--quiet"))
    std::fprintf(stderr, "statedict: wrote %s %s: %zu tensors, %.3f GB from %s in %.2f s\n", what.c_str(), sd::quote(out).c_str(),
                 ck.tensors.size(), static_cast<double>(bytes) / 1e9, ck.format.c_str(), secs);
  return 0;
}

int cmd_verify(const std::vector<std::string>& argv) {
  cli::Args a(argv,
              with_megatron({{"--rtol", true}, {"--atol", true}, {"--with-optimizer", false}, {"--from", true}, {"--io", true},
                             {"--threads", true}, {"--memory-budget", true}}),
              2, 2, "verify");
  sd::compare_options vo;
  auto num = [&](const char* opt) -> double {
    const auto v = a.value(opt);
    if (!v) return 0.0;
    try {
      std::size_t used = 0;
      const double d = std::stod(*v, &used);
      if (used == v->size() && d >= 0 && std::isfinite(d)) return d;
    } catch (...) {
    }
    a.fail(cli::errors::bad_value, std::string(opt) + " takes a non-negative number, not " + sd::quote(*v));
  };
  vo.rtol = num("--rtol");
  vo.atol = num("--atol");
  vo.exec = exec_options_from(a);  // no progress: verify starts none
  auto A = open_input(a.positional()[0], a);
  auto B = open_input(a.positional()[1], a);
  // Objects are compared as the data convert writes them as (an argparse.Namespace read from A
  // equals the dict of its attributes in B, statedict's output).
  (void)sd::formats::objects_as_data(A.checkpoint, {});
  (void)sd::formats::objects_as_data(B.checkpoint, {});
  const sd::comparison r = sd::compare(sd::formats::expand_ties(A.checkpoint), sd::formats::expand_ties(B.checkpoint), vo);
  for (const auto& d : r.differences) std::cout << d << "\n";
  if (r.omitted) std::cout << "... and " << r.omitted << " more differences\n";
  if (r.equal()) {
    std::cout << "equal: " << r.tensors << " tensors, " << r.values << " values\n";
    return 0;
  }
  std::cout << "different: " << r.differences.size() + r.omitted << " difference(s) in " << r.tensors << " tensors, " << r.values
            << " values\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      std::fputs(usage_text, args.empty() ? stderr : stdout);
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "--version") {
      std::printf("statedict %s\n", sd::version_string);
      return 0;
    }
    const std::string cmd = args[0];
    std::vector<std::string> rest(args.begin() + 1, args.end());
    for (const auto& r : rest)
      if (r == "--help" || r == "-h") {
        std::fputs(usage_text, stdout);
        return 0;
      }
    if (cmd == "inspect") return cmd_inspect(rest);
    if (cmd == "convert") return cmd_convert(rest);
    if (cmd == "verify") return cmd_verify(rest);
    std::fprintf(stderr, "statedict: unknown command %s (inspect, convert, verify; see statedict --help)\n", sd::quote(cmd).c_str());
    return 2;
  } catch (const sd::error& e) {
    if (progress) progress->clear();
    std::fprintf(stderr, "statedict: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    if (progress) progress->clear();
    std::fprintf(stderr, "statedict: out of memory\n");
    return 2;
  } catch (const std::exception& e) {
    if (progress) progress->clear();
    std::fprintf(stderr, "statedict: %s\n", e.what());
    return 2;
  }
}
