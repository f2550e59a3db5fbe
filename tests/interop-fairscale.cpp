// fairscale FSDP rank files as fairseq and metaseq save them (tests/python/gen_fairscale.py, both
// metadata schemas, experts, pure-padding ranks): every fixture consolidated bit for bit against
// its manifests, the ties of every unit restored (fairscale's own consolidation keeps only the last
// unit's), the optimizer state keyed by name; corrupt copies made with torch (a missing rank, a
// wrong padding, steps that differ, a tie to nothing, ...) each refused with its error id.
#include <doctest/doctest.h>

#include <statedict/formats/fairscale.hpp>
#include <statedict/formats/registry.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "layout_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;
using json = nlohmann::json;
using layout_test::compare;

namespace {

const fs::path fair_dir = fs::path(STATEDICT_FIXTURE_DIR) / "gen_fairscale";

std::vector<std::string> cases() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(fair_dir))
    if (e.is_directory()) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

json merged(const std::string& c) {
  json m = cli_test::load_json(fair_dir / (c + ".manifest.json"));
  const json o = cli_test::load_json(fair_dir / (c + ".optim.manifest.json"));
  for (const auto& [k, v] : o["tensors"].items()) m["tensors"][k] = v;
  for (const auto& [k, v] : o["values"].items()) m["values"][k] = v;
  return m;
}

int open_error(const fs::path& p, bool with_optimizer = false) {
  return layout_test::error_of([&] {
    formats::open_options o;
    o.with_optimizer = with_optimizer;
    (void)formats::open(p, o);
  });
}

/// The corrupt variants of case `c`: each a copy edited in Python with torch (`files` = the rank
/// files in order, `sds` = their torch.load'ed dicts, saved back after), all made in one run.
const std::vector<std::pair<std::string, std::string>>& edits() {
  static const std::vector<std::pair<std::string, std::string>> e{
      {"missing-middle", "os.remove(files[1])"},
      {"missing-last", "os.remove(files[2])"},
      {"padding", "meta(sds[2])['param_metadata'][1]['params']['flat_param_0']['padding'] += 1"},
      {"length", "sds[1]['model']['flat_param_0'] = sds[1]['model']['flat_param_0'][:-1].clone()"},
      {"differ", "meta(sds[1])['param_metadata'][1]['params']['flat_param_0']['names'][0] = 'other'"},
      {"numel", "for sd in sds:\n    meta(sd)['param_metadata'][1]['params']['flat_param_0']['numels'][0] += 1"},
      {"tie", "for sd in sds:\n    meta(sd)['param_metadata'][0]['shared_param_info'] = [('nothing', 'x')]"},
      {"buffer", "del sds[0]['model']['decoder.version']"},
      {"nometa", "for sd in sds:\n    del sd['shard_metadata']"},
      {"step", "sds[2]['last_optimizer_state']['state'][1]['step'] = 3"},
      {"groups", "sds[1]['last_optimizer_state']['param_groups'][0]['lr'] = 1.0"},
      {"loss-scale", "sds[1]['last_optimizer_state']['loss_scale'] = 8.0"},
      {"ids", "for sd in sds:\n    sd['last_optimizer_state']['param_groups'][0]['params'].pop()"},
      {"two", "import shutil\nshutil.copy(files[0], os.path.join(d, 'other-shard0.pt'))"},
  };
  return e;
}

fs::path variants(const std::string& c) {
  static fs::path made;
  if (!made.empty()) return made;
  const fs::path root = cli_test::scratch("fs-variants");
  std::string script = "import glob, os, re, shutil, sys, torch\n"
                       "def meta(sd):\n"
                       "    return sd.get('shard_metadata') or sd.get('fsdp_metadata')\n"
                       "def edit(d, code):\n"
                       "    files = sorted(glob.glob(os.path.join(d, '*-shard*.pt')), key=lambda f: int(re.search(r'shard(\\d+)\\.pt$', f).group(1)))\n"
                       "    sds = [torch.load(f) for f in files]\n"
                       "    exec(code, {'os': os, 'shutil': shutil, 'files': files, 'sds': sds, 'meta': meta, 'd': d})\n"
                       "    for f, sd in zip(files, sds):\n"
                       "        if os.path.exists(f):\n"
                       "            torch.save(sd, f)\n";
  for (const auto& [name, code] : edits()) {
    fs::copy(fair_dir / c, root / name, fs::copy_options::recursive);
    script += "edit(" + json((root / name).string()).dump() + ", " + json(code).dump() + ")\n";
  }
  cli_test::write_file(root / "edit.py", script);
  const auto r = cli_test::run({cli_test::python, (root / "edit.py").string()});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  made = root;
  return made;
}

}  // namespace

TEST_CASE("fairscale interop: every fixture consolidates bit for bit, with the ties of every unit") {
  const auto cs = cases();
  REQUIRE(cs.size() == 6);
  for (const std::string& c : cs) {
    CAPTURE(c);
    const json m = cli_test::load_json(fair_dir / (c + ".manifest.json"));
    const auto opened = formats::open(fair_dir / c);
    CHECK(opened.format->name() == "fairscale");
    CHECK(opened.checkpoint.format == m["format"].get<std::string>());
    auto problems = compare(opened.checkpoint, m);
    CHECK_MESSAGE(problems.empty(), cli_test::join(problems));
    // What fairscale's own consolidate_shard_weights loses is here, as a tie.
    const auto ties = formats::tied_names(opened.checkpoint.skeleton);
    for (const auto& lost : m["fairscale_output_lacks"]) {
      bool tied = false;
      for (const auto& t : ties) tied = tied || t.name == lost.get<std::string>();
      CHECK_MESSAGE(tied, lost.get<std::string>());
    }
    CHECK(ties.size() == m["aliases"].size());
    // The optimizer state keyed by name, steps checked equal on every rank.
    formats::open_options o;
    o.with_optimizer = true;
    const auto both = formats::open(fair_dir / c, o);
    problems = compare(both.checkpoint, merged(c));
    CHECK_MESSAGE(problems.empty(), cli_test::join(problems));
    // Any one rank file names the family.
    const auto one = formats::open(fair_dir / c / m["files"][1].get<std::string>());
    CHECK(one.format->name() == "fairscale");
    CHECK(sha256_tensors(one.checkpoint) == sha256_tensors(opened.checkpoint));
    // pread reads the same bytes
    formats::open_options po;
    po.mode = read_mode::pread;
    po.with_optimizer = true;
    CHECK(sha256_tensors(formats::open(fair_dir / c, po).checkpoint) == sha256_tensors(both.checkpoint));
  }
}

TEST_CASE("fairscale interop: a rank file alone is still a torch.save file to read as one") {
  // Read as fairscale, rank 0 of a family is consolidated; asked for torch, it is its own tree,
  // argparse.Namespace and numpy objects as data.
  formats::open_options o;
  o.format = "torch";
  o.settings.set<torch::load_options>().keep_unknown_objects = true;
  const auto t = formats::open(fair_dir / "fairseq_fsdp_ws2_fp32_expert" / "checkpoint_last-shard0.pt", o);
  CHECK(t.checkpoint.find("model.flat_param_0") != nullptr);
}

TEST_CASE("fairscale interop: corrupt rank files are refused with their error ids") {
  const std::string c = "metaseq_fsdp_ws3_fp16";
  SUBCASE("a missing middle rank") {
    const fs::path d = variants(c) / "missing-middle";
    CHECK(open_error(d) == errors::fairscale_missing_rank.id);
    // named by a file, the family is still incomplete: read as a plain torch.save file instead
    formats::open_options o;
    o.settings.set<torch::load_options>().keep_unknown_objects = true;
    CHECK(formats::open(d / "checkpoint_last-model_part-0-shard0.pt", o).format->name() == "torch");
  }
  SUBCASE("a missing last rank breaks the padding rule") {
    const fs::path d = variants(c) / "missing-last";
    CHECK(open_error(d) == errors::fairscale_padding.id);
  }
  SUBCASE("a padding that is not FSDP's") {
    const fs::path d = variants(c) / "padding";
    CHECK(open_error(d) == errors::fairscale_padding.id);
  }
  SUBCASE("a shard of the wrong length") {
    const fs::path d = variants(c) / "length";
    CHECK(open_error(d) == errors::fairscale_padding.id);
  }
  SUBCASE("ranks whose metadata differ") {
    const fs::path d = variants(c) / "differ";
    CHECK(open_error(d) == errors::fairscale_ranks_differ.id);
  }
  SUBCASE("numels that do not match the shapes") {
    const fs::path d = variants(c) / "numel";
    CHECK(open_error(d) == errors::fairscale_numel.id);
  }
  SUBCASE("a tie whose source is no parameter") {
    const fs::path d = variants(c) / "tie";
    CHECK(open_error(d) == errors::fairscale_bad_tie.id);
  }
  SUBCASE("a buffer that is not in the model") {
    const fs::path d = variants(c) / "buffer";
    CHECK(open_error(d) == errors::fairscale_missing_key.id);
  }
  SUBCASE("no metadata") {
    const fs::path d = variants(c) / "nometa";
    CHECK(open_error(d) == errors::unknown_format.id);
    formats::open_options o;
    o.format = "fairscale";
    CHECK(layout_test::error_of([&] { (void)formats::open(d, o); }) == errors::fairscale_not_found.id);
  }
  SUBCASE("steps that differ between ranks") {
    const fs::path d = variants(c) / "step";
    CHECK(open_error(d) == 0);
    CHECK(open_error(d, true) == errors::os_state_differs.id);
  }
  SUBCASE("param groups that differ between ranks") {
    const fs::path d = variants(c) / "groups";
    CHECK(open_error(d, true) == errors::fairscale_optim_differs.id);
  }
  SUBCASE("a loss scale that differs between ranks") {
    const fs::path d = variants(c) / "loss-scale";
    CHECK(open_error(d, true) == errors::fairscale_optim_differs.id);
  }
  SUBCASE("optimizer ids that do not match the flat parameters") {
    const fs::path d = variants(c) / "ids";
    CHECK(open_error(d, true) == errors::fairscale_bad_optimizer.id);
  }
  SUBCASE("two families in one folder") {
    const fs::path d = variants(c) / "two";
    CHECK(open_error(d) == errors::fairscale_ambiguous.id);
    // named by its file, the other family is read on its own: one rank of three is not a whole family
    CHECK(open_error(d / "other-shard0.pt") == errors::fairscale_padding.id);
  }
}
