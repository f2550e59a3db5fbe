// statedict: Megatron-LM's legacy per-rank layout (`--ckpt-format torch`), discovered and read
// into per-tensor assemblies of TP pieces (formats/megatron.hpp is the public header).
// SPDX-License-Identifier: MIT
//
//   latest_checkpointed_iteration.txt   "<iteration>" or "release"
//   iter_<iteration:07d>/ or release/
//     mp_rank_<tp:02d>[_<pp:03d>]/model_optim_rng.pt   (+ distrib_optim.pt with the distributed optimizer)
//
// Sources: checkpointing.py get_checkpoint_name, read_metadata, find_checkpoint_rank_0,
// generate_state_dict; legacy/model/gpt_model.py and language_model.py state_dict_for_save_checkpoint;
// transformer.py ParallelTransformer (layer offsets per pipeline stage and virtual chunk);
// tests/python/layouts/megatron.md sections 1, 2, 2.1, 2.2.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/value.hpp"
#include "../../core/visit.hpp"
#include "../optim_shard.hpp"
#include "files.hpp"
#include "megatron_place.hpp"
#include "megatron_rules.hpp"
#include "torch_refs.hpp"

namespace statedict::inline v0::megatron::detail {

/// True when `v` holds a tensor or a DCP tensor placeholder.
inline bool holds_tensor(const Value& v) {
  bool found = false;
  visit(v, [&](const Path&, const Value& x) {
    if (found) return visit_control::skip;
    found = x.is_tensor() || statedict::detail::torch_refs::is_ref(x);
    return found ? visit_control::skip : visit_control::descend;
  });
  return found;
}

// =============================================================================================
// Discovery

/// Reads a small text file whole (at most `max` bytes); nullopt when it cannot be read.
inline std::optional<std::string> small_file(const std::filesystem::path& p, std::uint64_t max, bool& too_large) {
  std::error_code ec;
  too_large = false;
  if (!std::filesystem::is_regular_file(p, ec)) return std::nullopt;
  const auto size = std::filesystem::file_size(p, ec);
  if (ec) return std::nullopt;
  if (size > max) {
    too_large = true;
    return std::nullopt;
  }
  std::ifstream f(p, std::ios::binary);
  std::string s(static_cast<std::size_t>(size), '\0');
  if (!f.read(s.data(), static_cast<std::streamsize>(size))) return std::nullopt;
  return s;
}

/// Where the iteration folder of a checkpoint is.
struct iteration_dir {
  std::filesystem::path dir;
  std::optional<std::uint64_t> iteration;  ///< from the tracker file
  bool release = false;
  bool tracker = false;  ///< a tracker file named it
};

/// `root` with latest_checkpointed_iteration.txt: the folder it names (throws errors::mg_bad_tracker
/// for text that is neither a positive integer nor "release"); without: `root` itself.
inline iteration_dir find_iteration(const std::filesystem::path& root, const limits& lim) {
  iteration_dir out;
  const auto tracker = root / "latest_checkpointed_iteration.txt";
  bool big = false;
  const auto text = small_file(tracker, lim.max_small_file_bytes, big);
  const std::string where = "file " + quote(tracker.string());
  if (big) throw_error(errors::mg_limit, where, "larger than limits::max_small_file_bytes");
  if (!text) {
    out.dir = root;
    out.release = root.filename() == "release";
    return out;
  }
  out.tracker = true;
  const std::string t = formats::detail::strip(*text);
  if (t == "release") {
    out.release = true;
    out.dir = root / "release";
    return out;
  }
  std::uint64_t it = 0;
  bool ok = !t.empty() && t.size() <= 18;
  for (char ch : t) ok = ok && ch >= '0' && ch <= '9';
  if (ok)
    for (char ch : t) it = it * 10 + static_cast<std::uint64_t>(ch - '0');
  if (!ok || it == 0)
    throw_error(errors::mg_bad_tracker, where, "holds " + quote(t) + ", expected a positive iteration number or 'release'");
  std::string name = std::to_string(it);
  if (name.size() < 7) name.insert(0, 7 - name.size(), '0');
  out.iteration = it;
  out.dir = root / ("iter_" + name);
  return out;
}

/// One `mp_rank_*` folder.
struct rank_dir {
  std::uint64_t tp = 0, pp = 0;
  bool pp_named = false;  ///< mp_rank_TT_PPP (PP > 1), not mp_rank_TT
  std::filesystem::path path;
};

/// `mp_rank_<tp>[_<pp>[_<ep>]]` (tp at least 2 digits, the others at least 3): (tp, pp, parts).
inline std::optional<std::vector<std::uint64_t>> parse_rank_dir(std::string_view name) {
  if (name.substr(0, 8) != "mp_rank_") return std::nullopt;
  std::vector<std::uint64_t> parts;
  std::string_view rest = name.substr(8);
  while (true) {
    const auto us = rest.find('_');
    const std::string_view d = rest.substr(0, us);
    const std::size_t min = parts.empty() ? 2 : 3;
    if (d.size() < min || d.size() > 9 || d.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
    std::uint64_t n = 0;
    for (char ch : d) n = n * 10 + static_cast<std::uint64_t>(ch - '0');
    parts.push_back(n);
    if (us == std::string_view::npos) break;
    rest = rest.substr(us + 1);
    if (parts.size() == 3) return std::nullopt;
  }
  return parts;
}

/// The rank folders of an iteration folder, by (pp, tp); throws for folders that cannot be a
/// Megatron rank (no model_optim_rng.pt, expert parallelism, two spellings).
inline std::vector<rank_dir> rank_dirs(const std::filesystem::path& dir, const limits& lim) {
  std::vector<rank_dir> out;
  std::error_code ec;
  const std::string where = "directory " + quote(dir.string());
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    const auto parts = parse_rank_dir(n);
    if (!parts) continue;
    std::error_code ec2;
    if (!it->is_directory(ec2)) continue;
    if (parts->size() == 3)
      throw_error(errors::mg_unsupported, where, quote(n) + " is an expert-parallel rank folder: expert parallelism is not supported");
    if (!std::filesystem::is_regular_file(it->path() / "model_optim_rng.pt", ec2))
      throw_error(errors::mg_rank_dirs, where, quote(n) + " has no model_optim_rng.pt");
    if (out.size() >= lim.max_ranks) throw_error(errors::mg_limit, where, "more rank folders than limits::max_ranks");
    out.push_back(rank_dir{(*parts)[0], parts->size() > 1 ? (*parts)[1] : 0, parts->size() > 1, it->path()});
  }
  std::sort(out.begin(), out.end(), [](const rank_dir& a, const rank_dir& b) { return std::tie(a.pp, a.tp) < std::tie(b.pp, b.tp); });
  for (std::size_t i = 1; i < out.size(); ++i) {
    if (out[i].pp_named != out[0].pp_named)
      throw_error(errors::mg_rank_dirs, where, "holds both mp_rank_TT and mp_rank_TT_PPP folders (" + quote(out[0].path.filename().string()) +
                                                   ", " + quote(out[i].path.filename().string()) + "); one checkpoint uses one spelling");
    if (out[i].pp == out[i - 1].pp && out[i].tp == out[i - 1].tp)
      throw_error(errors::mg_rank_dirs, where, "two folders for TP rank " + std::to_string(out[i].tp) + ", PP rank " + std::to_string(out[i].pp));
  }
  return out;
}

/// Checks that the folders are exactly TP x PP, spelled as Megatron spells them for PP `pp`.
inline void check_rank_set(const std::vector<rank_dir>& ranks, const facts& f, const std::filesystem::path& dir) {
  const std::string where = "directory " + quote(dir.string());
  if (ranks.size() != f.tp * f.pp)
    throw_error(errors::mg_rank_dirs, where, std::to_string(ranks.size()) + " rank folders, args say TP " + std::to_string(f.tp) + " x PP " +
                                                 std::to_string(f.pp) + " = " + std::to_string(f.tp * f.pp));
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const rank_dir& r = ranks[i];
    if (r.tp != i % f.tp || r.pp != i / f.tp)
      throw_error(errors::mg_rank_dirs, where, "has " + quote(r.path.filename().string()) + " where TP rank " + std::to_string(i % f.tp) +
                                                   ", PP rank " + std::to_string(i / f.tp) + " was expected (TP " + std::to_string(f.tp) +
                                                   " x PP " + std::to_string(f.pp) + ")");
    if (r.pp_named != (f.pp > 1))
      throw_error(errors::mg_rank_dirs, where, quote(r.path.filename().string()) + ": with PP " + std::to_string(f.pp) + " Megatron names rank folders " +
                                                   (f.pp > 1 ? "mp_rank_TT_PPP" : "mp_rank_TT"));
  }
}

// =============================================================================================
// Rank files

/// A parameter of a rank file, in named_parameters() order (the order the optimizer numbers them).
struct param_ref {
  std::string name;       ///< canonical (global layer number)
  bool head = false;      ///< the last stage's copy of tied word embeddings (word_embeddings_for_head)
  const TensorView* view = nullptr;
};

/// One rank file, loaded (tensors are views into it, never read while describing).
struct rank_file {
  rank_dir dir;
  optim_shard::LoadedFile file;
  std::string where;                          ///< "file '<path>'"
  std::uint32_t source = 0;                   ///< its index among the description's sources
  std::vector<std::vector<param_ref>> chunks;  ///< per model chunk (virtual PP), in file order
};

/// The top-level dict of a rank file; `what` values checked.
inline const Dict& top_dict(const rank_file& rf) {
  if (!rf.file.tree.is_dict()) throw_error(errors::mg_bad_rank_file, rf.where, "holds a " + po::kind_of(rf.file.tree) + ", expected a dict");
  return rf.file.tree.as_dict();
}

/// checkpoint_version of a rank file (absent: 0).
inline double checkpoint_version(const rank_file& rf) {
  const Value* v = top_dict(rf).find("checkpoint_version");
  if (!v || v->is_none()) return 0;
  if (!v->is_double() && !v->is_int())
    throw_error(errors::mg_bad_rank_file, rf.where, "checkpoint_version is " + po::kind_of(*v) + ", expected a float");
  const double d = v->as_number();
  if (d != 0 && d != 1.0 && d != 2.0 && d != 3.0)
    throw_error(errors::mg_unsupported, rf.where, "checkpoint_version " + version_text(d) + " is not one of 0, 1.0, 2.0, 3.0");
  return d;
}

/// The iteration a rank file records (`iteration`, or the oldest files' `total_iters`).
inline std::optional<std::int64_t> file_iteration(const rank_file& rf) {
  const Dict& d = top_dict(rf);
  const Value* v = d.find("iteration");
  if (!v) v = d.find("total_iters");
  if (!v || v->is_none()) return std::nullopt;
  if (!v->is_int()) throw_error(errors::mg_bad_rank_file, rf.where, "iteration is " + po::kind_of(*v) + ", expected an int");
  return v->as_int();
}

/// The args of a rank file.
inline const Value& args_of(const rank_file& rf) {
  const Value* a = top_dict(rf).find("args");
  if (!a) throw_error(errors::mg_bad_args, rf.where, "has no 'args' (Megatron stores the run's argparse.Namespace in every rank file)");
  return *a;
}

/// The model chunks of a rank file: `model`, or `model0` .. `model<n-1>` with virtual PP.
inline std::vector<const Value*> model_chunks(const rank_file& rf, const limits& lim) {
  const Dict& d = top_dict(rf);
  if (const Value* m = d.find("model")) return {m};
  std::vector<const Value*> out;
  while (const Value* m = d.find("model" + std::to_string(out.size()))) {
    if (out.size() >= lim.max_layers) throw_error(errors::mg_limit, rf.where, "more model chunks than limits::max_layers");
    out.push_back(m);
  }
  if (out.empty()) throw_error(errors::mg_bad_rank_file, rf.where, "has neither 'model' nor 'model0'");
  return out;
}

/// Leaves of `v` (nested string-keyed dicts) as (dotted key, leaf), in order.
inline void leaves(const Value& v, const std::string& prefix, std::vector<std::pair<std::string, const Value*>>& out, const std::string& where,
                   std::size_t depth = 0) {
  if (!v.is_dict()) {
    out.emplace_back(prefix, &v);
    return;
  }
  if (depth > 64) throw_error(errors::mg_bad_rank_file, where, "model dict nested deeper than 64 levels at " + quote(prefix));
  for (const auto& [k, c] : v.as_dict()) {
    if (!k.is_string()) throw_error(errors::mg_bad_rank_file, where, "model key " + k.str() + " under " + quote(prefix) + " is not a str");
    leaves(c, prefix.empty() ? k.as_string() : prefix + "." + k.as_string(), out, where, depth + 1);
  }
}

/// What reading the model of every rank file produced.
struct model_read {
  std::map<std::string, assembly> tensors;  ///< by canonical name
  std::vector<std::string> order;           ///< names in order of first appearance
  std::set<std::uint64_t> layers;           ///< global layers seen
};

/// First global layer of model chunk v on pipeline stage p (ParallelTransformer's offsets).
inline std::uint64_t layer_offset(const facts& f, std::uint64_t p, std::uint64_t v) {
  const std::uint64_t per_chunk = f.num_layers / (f.pp * f.vpp);
  return v * (f.num_layers / f.vpp) + p * per_chunk;
}

/// Reads model chunk `v` of rank file `rf` into `m` and records its parameters in rf.chunks.
inline void read_chunk(rank_file& rf, const Value& chunk, std::uint64_t v, const std::string& cw, const facts& f, const std::vector<rule>& rules,
                       bool defaults, model_read& m, const limits& lim) {
  if (!chunk.is_dict()) throw_error(errors::mg_bad_rank_file, cw, "is a " + po::kind_of(chunk) + ", expected a dict");
  const Dict& cd = chunk.as_dict();
  for (const auto& [k, x] : cd) {
    const std::string ks = k.str();
    if (ks == "language_model" || ks == "word_embeddings_for_head") continue;
    if (ks.rfind("decoder.", 0) == 0 || ks.rfind("embedding.", 0) == 0)
      throw_error(errors::mg_unsupported, cw, "holds Megatron-core keys (" + quote(ks) + "): a megatron.core GPTModel saved in the legacy format is not supported");
    throw_error(errors::mg_unsupported, cw, "has key " + quote(ks) + ": only the GPT model (language_model, word_embeddings_for_head) is supported");
  }
  const Value* lm = cd.find("language_model");
  if (!lm) throw_error(errors::mg_bad_rank_file, cw, "has no 'language_model'");
  std::vector<std::pair<std::string, const Value*>> ls;
  leaves(*lm, "", ls, cw);
  const std::uint64_t per_chunk = f.num_layers / (f.pp * f.vpp), offset = layer_offset(f, rf.dir.pp, v);
  std::vector<param_ref> params;
  auto add = [&](std::string name, const Value& leaf, const std::string& key, bool head) {
    if (!leaf.is_tensor())
      throw_error(errors::mg_bad_rank_file, cw, "key " + quote(key) + " is a " + po::kind_of(leaf) + ", expected a tensor");
    auto [it, fresh] = m.tensors.try_emplace(name);
    assembly& a = it->second;
    if (fresh) {
      if (m.tensors.size() > lim.max_tensors) throw_error(errors::mg_limit, cw, "more tensors than limits::max_tensors");
      a.name = name;
      a.how = rule_for(name, rules, defaults);
      a.ranks.assign(f.tp, piece{});
      m.order.push_back(name);
    }
    if (head) {
      // One set of copies per source stage; the last stage of this TP rank adds its piece.
      if (a.copies.empty()) a.copies.assign(1, std::vector<piece>(f.tp));
      if (a.copies[0][rf.dir.tp].view)
        throw_error(errors::mg_duplicate, "tensor " + quote(name), "two copies for the head on TP rank " + std::to_string(rf.dir.tp));
      a.copies[0][rf.dir.tp] = piece{&leaf.as_tensor(), rf.where, rf.source};
    } else {
      if (a.ranks[rf.dir.tp].view)
        throw_error(errors::mg_duplicate, "tensor " + quote(name), "held twice by TP rank " + std::to_string(rf.dir.tp) + ": in " +
                                                                        a.ranks[rf.dir.tp].where + " and in " + cw + " (" + quote(key) + ")");
      a.ranks[rf.dir.tp] = piece{&leaf.as_tensor(), cw, rf.source};
    }
    params.push_back(param_ref{name, head, &leaf.as_tensor()});
  };
  for (const auto& [key, leaf] : ls) {
    if (key.size() >= 12 && key.compare(key.size() - 12, 12, "_extra_state") == 0) continue;  // TE/linear extra state (None)
    std::string n = normalise_lm_key(key);
    const std::string first = n.substr(0, n.find('.'));
    if (first == "pooler" || first == "decoder")
      throw_error(errors::mg_unsupported, cw, "has " + quote(key) + ": BERT / T5 models (pooler, decoder) are not supported");
    if (auto layer = layer_of(n, "encoder.layers.")) {
      if (layer->first >= per_chunk)
        throw_error(errors::mg_bad_rank_file, cw, "key " + quote(key) + " names local layer " + std::to_string(layer->first) + ", but a chunk holds " +
                                                      std::to_string(per_chunk) + " layers (num_layers " + std::to_string(f.num_layers) + ", PP " +
                                                      std::to_string(f.pp) + ", virtual PP " + std::to_string(f.vpp) + ")");
      const std::uint64_t g = offset + layer->first;
      m.layers.insert(g);
      n = "encoder.layers." + std::to_string(g) + "." + layer->second;
    }
    add("language_model." + n, *leaf, key, false);
  }
  if (const Value* head = cd.find("word_embeddings_for_head")) {
    if (f.untied)
      throw_error(errors::mg_bad_rank_file, cw, "has word_embeddings_for_head, but args.untie_embeddings_and_output_weights is set");
    std::vector<std::pair<std::string, const Value*>> hs;
    leaves(*head, "", hs, cw);
    for (const auto& [key, leaf] : hs) add("language_model.embedding.word_embeddings." + key, *leaf, "word_embeddings_for_head." + key, true);
  }
  rf.chunks.push_back(std::move(params));
}

/// Reads the model of every rank file; checks that every layer is there and every tensor is held
/// by one stage (TP pieces) plus, for tied embeddings with PP, the head copy.
inline model_read read_models(std::vector<rank_file>& files, const facts& f, const std::vector<rule>& rules, bool defaults, const limits& lim) {
  model_read m;
  if (f.num_layers % (f.pp * f.vpp) != 0)
    throw_error(errors::mg_bad_args, files[0].where, "num_layers " + std::to_string(f.num_layers) + " is not a multiple of PP " + std::to_string(f.pp) +
                                                         " x virtual PP " + std::to_string(f.vpp));
  for (rank_file& rf : files) {
    const auto chunks = model_chunks(rf, lim);
    if (chunks.size() != f.vpp)
      throw_error(errors::mg_bad_rank_file, rf.where, std::to_string(chunks.size()) + " model chunk(s), args give virtual PP " + std::to_string(f.vpp));
    for (std::uint64_t v = 0; v < chunks.size(); ++v)
      read_chunk(rf, *chunks[v], v, rf.where + ": " + (chunks.size() == 1 ? std::string("model") : "model" + std::to_string(v)), f, rules, defaults,
                 m, lim);
  }
  for (std::uint64_t l = 0; l < f.num_layers; ++l)
    if (!m.layers.count(l))
      throw_error(errors::mg_missing, "Megatron checkpoint " + quote(files[0].dir.path.parent_path().string()),
                  "no rank file holds layer " + std::to_string(l) + " of " + std::to_string(f.num_layers));
  return m;
}

/// Canonical order: embeddings (word first), layers by global number (file order inside one),
/// the final norm, the rest (output layer) - Megatron's loader order.
inline std::vector<std::string> canonical_order(const model_read& m) {
  auto rank = [](const std::string& k) -> std::pair<int, std::uint64_t> {
    if (k.rfind("language_model.embedding.", 0) == 0) return {0, k.find("word_") != std::string::npos ? 0U : 1U};
    if (auto l = layer_of(k, "language_model.encoder.layers.")) return {1, l->first};
    if (k.rfind("language_model.encoder.", 0) == 0) return {2, 0};
    return {3, 0};
  };
  std::vector<std::string> out = m.order;
  std::stable_sort(out.begin(), out.end(), [&](const std::string& a, const std::string& b) { return rank(a) < rank(b); });
  return out;
}

/// Where a canonical name sits in the tree: language_model / embedding / <sub> / <leaf>, or
/// language_model / encoder|output_layer|... / <rest> (Megatron's nesting of one model chunk).
inline std::vector<std::string> tree_path(const std::string& name) {
  std::string rest = name.substr(std::string("language_model.").size());
  std::vector<std::string> p{"language_model"};
  const auto dot = rest.find('.');
  p.push_back(rest.substr(0, dot));
  rest = dot == std::string::npos ? std::string() : rest.substr(dot + 1);
  if (p.back() == "embedding") {
    const auto d2 = rest.find('.');
    if (d2 != std::string::npos) {
      p.push_back(rest.substr(0, d2));
      rest = rest.substr(d2 + 1);
    }
  }
  if (!rest.empty()) p.push_back(rest);
  return p;
}

}  // namespace statedict::inline v0::megatron::detail
