// `statedict convert` end to end (shared by tests/cli-convert-*.cpp, one executable per group of
// fixture generators so each stays short): every fixture converted to one .safetensors file, to
// a torch.save .pt, to a Hugging Face sharded directory (--max-shard-size), with --dtype BF16 and
// with --only PREFIX; each output re-inspected by statedict and compared with the fixture's
// manifest, and checked by real PyTorch (tests/cli_oracle.py: torch.load bit for bit with tied
// names sharing storage, the strict safetensors reader, BF16 values equal to torch's
// .to(torch.bfloat16)).
#pragma once

#include "cli_util.hpp"

namespace cli_test {

inline std::uint64_t manifest_bytes(const json& m) {
  static const std::map<std::string, std::uint64_t> bits = {
      {"BOOL", 8}, {"U8", 8},   {"I8", 8},   {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"I16", 16}, {"U16", 16}, {"F16", 16},
      {"BF16", 16}, {"I32", 32}, {"U32", 32}, {"F32", 32},    {"C64", 64},    {"F64", 64}, {"I64", 64}, {"U64", 64}, {"C128", 128}};
  std::uint64_t total = 0;
  const json aliases = m.value("aliases", json::object());
  for (const auto& [n, t] : m["tensors"].items()) {
    if (aliases.contains(n)) continue;
    std::uint64_t e = 1;
    for (const auto& d : t["shape"]) e *= d.get<std::uint64_t>();
    const auto it = bits.find(t["dtype"].get<std::string>());
    total += e * (it == bits.end() ? 8 : it->second) / 8;
  }
  return total;
}

inline bool is_floating_name(const std::string& d) {
  return d == "F16" || d == "BF16" || d == "F32" || d == "F64" || d.rfind("F8", 0) == 0;
}

/// The prefix `--only` keeps in a fixture: the first dotted component of its first tensor name.
inline std::string only_prefix(const json& m) {
  if (m["tensors"].empty()) return "";
  const std::string first = m["tensors"].begin().key();
  return first.substr(0, first.find('.'));
}

struct convert_counts {
  std::size_t fixtures = 0, torch_checked = 0, safetensors_checked = 0, hf_sharded = 0, cast_checked = 0, only_checked = 0,
              transformed = 0;
};

/// `name` as an ECMAScript regular expression that matches exactly it.
inline std::string regex_quote(const std::string& name) {
  std::string out;
  for (const char c : name) {
    if (std::strchr("\\^$.|?*+()[]{}", c) != nullptr) out += '\\';
    out += c;
  }
  return out;
}

/// The transforms check_convert applies with the name options of convert: which tensor
/// `--drop` removes (a stored one no other name ties to; none when there is no such tensor but
/// the only one), and the new name of every tensor and value (`--strip-prefix P. --add-prefix
/// net.`, P the first component of the first name); `rename` maps old names to new ones (the
/// dropped name to null), `want` is the manifest the output must have with --dtype BF16.
struct transform_case {
  std::vector<std::string> args;
  json rename = json::object();
  json want;
};

inline transform_case transform_for(const json& m, const std::set<std::string>& integer_origin) {
  transform_case c;
  const std::string p = only_prefix(m) + ".";
  auto renamed = [&](const std::string& n) { return "net." + (n.rfind(p, 0) == 0 && n.size() > p.size() ? n.substr(p.size()) : n); };
  const json aliases = m.value("aliases", json::object());
  std::set<std::string> targets;
  for (const auto& kv : aliases.items()) targets.insert(kv.value().get<std::string>());
  std::string dropped;
  std::size_t stored = 0;
  for (const auto& kv : m["tensors"].items())
    if (!aliases.contains(kv.key())) {
      ++stored;
      if (!targets.count(kv.key())) dropped = kv.key();
    }
  if (stored < 2) dropped.clear();
  if (!dropped.empty()) c.args = {"--drop", regex_quote(dropped)};
  c.args.insert(c.args.end(), {"--strip-prefix", p, "--add-prefix", "net.", "--dtype", "BF16"});
  c.want = {{"tensors", json::object()}, {"values", json::object()}, {"aliases", json::object()}};
  for (const auto& kv : m["tensors"].items()) {
    if (kv.key() == dropped) {
      c.rename[kv.key()] = nullptr;
      continue;
    }
    json t = kv.value();
    if (is_floating_name(t["dtype"]) && !integer_origin.count(kv.key())) t["dtype"] = "BF16";
    c.rename[kv.key()] = renamed(kv.key());
    c.want["tensors"][renamed(kv.key())] = t;
  }
  for (const auto& kv : m.value("values", json::object()).items()) {
    c.rename[kv.key()] = renamed(kv.key());
    c.want["values"][renamed(kv.key())] = kv.value();
  }
  for (const auto& kv : aliases.items()) c.want["aliases"][renamed(kv.key())] = renamed(kv.value().get<std::string>());
  return c;
}

/// Everything above for every fixture of the given generators.
inline convert_counts check_convert(const std::vector<std::string>& generators, const std::string& scratch_name) {
  static const std::set<std::string> refused = {"gen_torch_files/malicious_os_system", "gen_safetensors/exotic_dtypes"};
  const fs::path work = scratch(scratch_name);
  convert_counts n;
  json jobs = json::array();
  std::vector<std::string> job_label;
  auto add_job = [&](json j, const std::string& label) {
    jobs.push_back(std::move(j));
    job_label.push_back(label);
  };

  for (const auto& g : generators) {
    for (const fixture& f : fixtures(g)) {
      if (refused.count(f.label())) continue;
      CAPTURE(f.label());
      ++n.fixtures;
      const fs::path dir = work / (g + "-" + std::to_string(n.fixtures));
      fs::create_directories(dir);
      const bool torch_ok = torch113_loads(f.manifest);
      // Tensors the reader made floating from integers (DeepSpeed's buffers): --dtype leaves them.
      std::set<std::string> integer_origin;
      for (const auto& [t, e] : inspect(f.path)["tensors"].items())
        if (e.contains("converted_from") && !is_floating_name(e["converted_from"])) integer_origin.insert(t);
      bool st_ok = true;  // safetensors has no C128
      for (const auto& [t, e] : f.manifest["tensors"].items())
        if (e["dtype"] == "C128") st_ok = false;
      auto convert = [&](std::vector<std::string> args) {
        args.insert(args.begin(), {"convert", f.path.string()});
        const run_result r = cli(args);
        CHECK_MESSAGE(r.code == 0, f.label() << ": statedict convert " << args[2] << " ...: " << r.describe());
        return r.code == 0;
      };

      // One safetensors file.
      const fs::path st = dir / "out.safetensors";
      if (!st_ok) {
        const run_result r = cli({"convert", f.path.string(), st.string()});
        INFO(r.describe());
        CHECK(r.code == 2);
        CHECK(lines(r.err).size() == 1);
        CHECK(r.err.find("C128") != std::string::npos);
        CHECK_FALSE(fs::exists(st));
      } else if (convert({st.string()})) {
        const auto p = compare_with_manifest(inspect(st), f.manifest);
        CHECK_MESSAGE(p.empty(), f.label() << " -> .safetensors re-inspected:" << join(p));
        // Tied names are stored once.
        const auto entries = safetensors_entries(st);
        const json aliases = f.manifest.value("aliases", json::object());
        for (const auto& kv : aliases.items()) {
          const std::string a = kv.key();
          CHECK_MESSAGE(!entries.count(a), "tied name '" << a << "' stored twice");
        }
        add_job({{"kind", "safetensors"}, {"file", st.string()}, {"manifest", f.manifest}}, f.label() + " .safetensors");
        ++n.safetensors_checked;
      }

      // torch.save file.
      const fs::path pt = dir / "out.pt";
      if (convert({pt.string()})) {
        const auto p = compare_with_manifest(inspect(pt), f.manifest);
        CHECK_MESSAGE(p.empty(), f.label() << " -> .pt re-inspected:" << join(p));
        if (torch_ok) {
          add_job({{"kind", "torch"}, {"file", pt.string()}, {"manifest", f.manifest}}, f.label() + " .pt");
          ++n.torch_checked;
        }
      }

      // Hugging Face sharded directory: about three shards.
      const std::uint64_t total = manifest_bytes(f.manifest);
      const std::uint64_t max_shard = std::max<std::uint64_t>(8, total / 3 + 1);
      const fs::path hf = dir / "hf";
      if (st_ok && convert({hf.string(), "--max-shard-size", std::to_string(max_shard)})) {
        const fs::path index = hf / "model.safetensors.index.json";
        if (fs::exists(index)) {
          ++n.hf_sharded;
          const json idx = load_json(index);
          const json wm = idx.at("weight_map");
          const json aliases = f.manifest.value("aliases", json::object());
          std::set<std::string> files;
          for (const auto& [t, file] : wm.items()) files.insert(file.get<std::string>());
          for (const auto& kv : f.manifest["tensors"].items()) {
            const std::string t = kv.key();
            if (!aliases.contains(t)) CHECK_MESSAGE(wm.contains(t), "index lacks tensor '" << t << "'");
          }
          for (const auto& kv : wm.items()) {
            const std::string t = kv.key();
            CHECK_MESSAGE(f.manifest["tensors"].contains(t), "index lists unknown tensor '" << t << "'");
          }
          std::uint64_t listed = 0;
          for (const auto& file : files) {
            REQUIRE(fs::exists(hf / file));
            for (const auto& kv : safetensors_entries(hf / file)) {
              const std::string t = kv.first;
              CHECK_MESSAGE(wm.value(t, "") == file, "tensor '" << t << "' in " << file << " but the index says " << wm.value(t, "?"));
              listed += kv.second.end - kv.second.begin;
            }
          }
          CHECK(listed == total);
          CHECK(idx["metadata"].value("total_size", std::uint64_t{0}) == total);
          if (total > 0 && f.manifest["tensors"].size() > 3) CHECK(files.size() >= 2);
        } else {
          CHECK(fs::exists(hf / "model.safetensors"));
        }
        const auto p = compare_with_manifest(inspect(hf), f.manifest);
        CHECK_MESSAGE(p.empty(), f.label() << " -> HF sharded directory re-inspected:" << join(p));
        if (fs::exists(index)) {
          const auto pi = compare_with_manifest(inspect(index), f.manifest);
          CHECK_MESSAGE(pi.empty(), f.label() << " -> HF index re-inspected:" << join(pi));
        }
      }

      // --dtype BF16: floating tensors become BF16, the rest keep their dtype.
      const fs::path bf = dir / "bf16.pt";
      if (convert({bf.string(), "--dtype", "BF16"})) {
        const json got = inspect(bf);
        json want = f.manifest;
        for (auto& [t, e] : want["tensors"].items())
          if (is_floating_name(e["dtype"]) && !integer_origin.count(t)) e["dtype"] = "BF16";
        compare_options o;
        o.hashes = false;
        const auto p = compare_with_manifest(got, want, o);
        CHECK_MESSAGE(p.empty(), f.label() << " --dtype BF16 re-inspected:" << join(p));
        for (const auto& kv : f.manifest["tensors"].items())
          if ((!is_floating_name(kv.value()["dtype"]) || integer_origin.count(kv.key())) && got["tensors"].contains(kv.key()))
            CHECK(got["tensors"][kv.key()]["sha256"] == kv.value()["sha256"]);
        if (torch_ok && fs::exists(pt)) {
          add_job({{"kind", "cast"}, {"orig", pt.string()}, {"cast", bf.string()}, {"dtype", "BF16"}, {"keep", integer_origin}},
                  f.label() + " --dtype BF16");
          ++n.cast_checked;
        }
      }

      // --drop, --strip-prefix, --add-prefix and --dtype together, to a .pt and a .safetensors:
      // the new names, the ties and the values as the manifest has them, the floating tensors
      // equal to torch's .to(torch.bfloat16) of the untransformed output.
      if (f.manifest["tensors"].size() > 0 && !f.manifest["tensors"].contains("")) {
        const transform_case tc = transform_for(f.manifest, integer_origin);
        compare_options o;
        o.hashes = false;
        for (const char* ext : {".pt", ".safetensors"}) {
          const bool to_st = std::string(ext) == ".safetensors";
          if (to_st && !st_ok) continue;
          const fs::path out = dir / (std::string("transformed") + ext);
          std::vector<std::string> args = {out.string()};
          args.insert(args.end(), tc.args.begin(), tc.args.end());
          if (!convert(args)) continue;
          const auto p = compare_with_manifest(inspect(out), tc.want, o);
          CHECK_MESSAGE(p.empty(), f.label() << " " << join(args) << " re-inspected:" << join(p));
          ++n.transformed;
          if (torch_ok && fs::exists(pt))
            add_job({{"kind", "cast"}, {"orig", pt.string()}, {"cast", out.string()}, {"dtype", "BF16"}, {"rename", tc.rename},
                     {"aliases", tc.want["aliases"]}, {"keep", integer_origin}},
                    f.label() + " transformed" + ext);
        }
      }

      // --only PREFIX.
      const std::string prefix = only_prefix(f.manifest);
      const fs::path only = dir / (st_ok ? "only.safetensors" : "only.pt");
      if (!prefix.empty() && convert({only.string(), "--only", prefix})) {
        const json sub = manifest_subset(f.manifest, prefix);
        const auto p = compare_with_manifest(inspect(only), sub);
        CHECK_MESSAGE(p.empty(), f.label() << " --only " << prefix << ":" << join(p));
        CHECK(!sub["tensors"].empty());
        ++n.only_checked;
      }
    }
  }

  const auto results = oracle(jobs, work);
  for (std::size_t i = 0; i < results.size(); ++i)
    CHECK_MESSAGE(results[i].empty(), job_label[i] << ": PyTorch disagrees:" << join(results[i]));
  MESSAGE(n.fixtures << " fixtures converted; PyTorch checked " << n.torch_checked << " .pt, " << n.safetensors_checked
                     << " .safetensors, " << n.cast_checked << " BF16 casts; " << n.hf_sharded << " sharded HF outputs; "
                     << n.only_checked << " --only subsets, " << n.transformed << " transformed outputs");
  return n;
}

}  // namespace cli_test
