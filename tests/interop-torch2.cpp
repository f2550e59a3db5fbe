// Today's PyTorch as the oracle: the fixtures PyTorch 2.14, safetensors 0.8 and transformers 5 wrote
// (tests/python/torch2, in the Debian sid root) are read equal to their manifests, and what
// statedict writes from them loads in torch 2.14 equal to the source: .pt with torch.load's
// default weights_only=True and with mmap=True, naming only globals torch.save itself writes;
// DCP for 1, 2 and 3 ranks with dcp.load(no_dist=True) and dcp_to_torch_save; safetensors with
// safe_open; Hugging Face folders with from_pretrained giving the source model's logits.
#include <doctest/doctest.h>

#include "interop_t2.hpp"

using namespace t2_test;

namespace {

/// The fixtures statedict refuses, and the error id: pickle protocol 0, which torch.load cannot
/// read either (torch.pickle_protocol_0). Every other fixture must be read equal to its manifest.
const std::map<std::string, std::set<int>> may_refuse = {{"legacy_p0", {513}}, {"zip_p0", {513}}};

/// Every global the torch.save files of gen_t2_torch name: what torch.save writes.
std::vector<std::string> torch_save_globals() {
  std::set<std::string> all;
  for (const fixture& f : fixtures("torch2/gen_t2_torch"))
    for (const auto& g : f.manifest.value("pickle_globals", json::array())) all.insert(g.get<std::string>());
  return {all.begin(), all.end()};
}

/// The tensors of a torch.save file as torch::read() gives them (not describe(): the values a
/// program sees), against the manifest: dtype, shape and sha256 of each.
std::vector<std::string> read_values_problems(const fixture& f) {
  std::vector<std::string> p;
  const sd::torch::File file = sd::torch::read(f.path);
  const sd::FlatStateDict flat = sd::flatten(file.value);
  const json& want = f.manifest["tensors"];
  for (const auto& [name, v] : flat.tensors) {
    if (!want.contains(name)) {
      p.push_back("read(): tensor '" + name + "' unexpected");
      continue;
    }
    if (std::string(sd::name(v.dtype())) != want[name]["dtype"]) p.push_back("read(): tensor '" + name + "': dtype");
    if (sd::sha256_hex(v) != want[name]["sha256"]) p.push_back("read(): tensor '" + name + "': sha256 differs");
  }
  return p;
}

}  // namespace

TEST_CASE("torch 2.14 fixtures read as their manifests say; .pt, safetensors and HF outputs load in torch 2.14 equal") {
  const fs::path work = scratch("interop-torch2");
  const auto allowed_globals = torch_save_globals();
  REQUIRE(std::find(allowed_globals.begin(), allowed_globals.end(), "torch.storage.UntypedStorage") != allowed_globals.end());
  job_list jobs;
  std::size_t read = 0, refused = 0, outputs = 0;
  for (const std::string g : {"gen_t2_torch", "gen_t2_safetensors"}) {
    const auto all = fixtures("torch2/" + g);
    REQUIRE_MESSAGE(!all.empty(), "no torch2 fixtures (tests/python/torch2/generate_all.sh)");
    for (const fixture& f : all) {
      CAPTURE(f.label());
      json want = statedict_view(f.manifest);
      // x[:6] and x[4:] of an unsaved x overlap without one containing the other: stored as two
      // tensors by design (docs/flatten.md, "what is tied", rule 3), so not expected tied.
      if (want.contains("aliases") && want["aliases"].value("second", "") == "first") want["aliases"].erase("second");
      sd::formats::Opened o;
      const int id = error_of([&] { o = sd::formats::open(f.path); });
      if (id != 0) {
        const auto it = may_refuse.find(f.name);
        CHECK_MESSAGE((it != may_refuse.end() && it->second.count(id)), "refused with error " << id);
        ++refused;
        continue;
      }
      ++read;
      const auto p = compare_with_manifest(describe_json(o.checkpoint), want);
      CHECK_MESSAGE(p.empty(), "read:" << join(p));
      if (f.format() == "torch" || f.format() == "torch_legacy") {
        const auto v = read_values_problems(f);
        CHECK_MESSAGE(v.empty(), join(v));
      }
      // .pt: the default torch.load and mmap=True, aliases kept, only torch.save's globals.
      const fs::path pt = work / (f.name + ".pt");
      sd::formats::save(o.checkpoint, pt);
      jobs.add(f.label() + " -> .pt", {{"kind", "torch"}, {"path", pt.string()}, {"manifest", want}, {"check_aliases", true}});
      jobs.add(f.label() + " -> .pt globals", {{"kind", "globals"}, {"path", pt.string()}, {"allowed", allowed_globals}});
      ++outputs;
      if (f.format() == "safetensors") {
        const fs::path st = work / (f.name + ".safetensors");
        sd::formats::save(o.checkpoint, st);
        jobs.add(f.label() + " -> .safetensors", {{"kind", "safetensors"}, {"path", st.string()}, {"manifest", f.manifest_path.string()}});
        ++outputs;
      }
      if (f.format() == "hf_safetensors" || f.format() == "hf_torch") {
        const fs::path hf = work / (f.name + "-hf");
        sd::formats::save_options so;
        so.max_shard_size = 20'000;
        sd::formats::save(o.checkpoint, hf, so);
        jobs.add(f.label() + " -> HF shards", {{"kind", "safetensors"}, {"path", hf.string()}, {"manifest", f.manifest_path.string()}});
        jobs.add(f.label() + " -> HF shards, from_pretrained",
                 {{"kind", "hf"}, {"path", hf.string()}, {"manifest", f.manifest_path.string()}, {"config_from", f.path.string()}});
        ++outputs;
      }
    }
  }
  CHECK(read >= 23);  // every fixture but the pending protocols
  const std::size_t checked = jobs.check(work);
  MESSAGE(read << " torch 2.14 fixtures read, " << refused << " refused as allowed, " << outputs << " outputs, " << checked
               << " torch 2.14 checks");
  drop_scratch("interop-torch2");
}

TEST_CASE("--to dcp (2.x layout) for 1, 2 and 3 ranks loads in torch 2.14's dcp.load and dcp_to_torch_save, equal to the source") {
  const fs::path work = scratch("interop-torch2-dcp");
  job_list jobs;
  std::vector<fixture> sources = fixtures("torch2/gen_t2_dcp");
  REQUIRE(sources.size() == 4);
  for (const fixture& f : fixtures("torch2/gen_t2_torch"))
    if (f.name == "training_state" || f.name == "dtypes" || f.name == "big_endian_untyped") sources.push_back(f);
  REQUIRE(sources.size() == 7);
  std::size_t without = 0;
  for (const fixture& f : sources) {
    CAPTURE(f.label());
    sd::formats::Opened o = sd::formats::open(f.path);
    // torch 2.14's DCP loader cannot receive float4_e2m1fn_x2 ("fill_cpu" not implemented) or
    // bits tensors ("Bits types are undefined") whatever wrote them: those are left out here.
    json want = f.manifest;
    std::vector<std::string> keep;
    for (const sd::TensorInfo& t : o.checkpoint.tensors) {
      if (t.dtype == sd::dtype::F4_X2 || sd::name(t.dtype).rfind("BITS", 0) == 0) {
        want["tensors"].erase(t.name);
        ++without;
      } else {
        keep.push_back(t.name);
      }
    }
    if (keep.size() != o.checkpoint.tensors.size()) o.checkpoint = sd::formats::select(o.checkpoint, keep);
    for (const std::uint32_t m : {1U, 2U, 3U}) {
      const fs::path out = work / (f.name + "-m" + std::to_string(m));
      sd::formats::save_options so;
      so.format = "dcp";
      so.world_size = m;
      sd::formats::save(o.checkpoint, out, so);
      CHECK(sd::dcp::detect(out).rule.find("2.x layout") != std::string::npos);
      // Read back by statedict: the same tensors and values (DCP stores every name as its own item).
      compare_options co;
      co.aliases = false;
      const auto p = compare_with_manifest(describe_json(sd::formats::open(out).checkpoint), want, co);
      CHECK_MESSAGE(p.empty(), "M=" << m << " read back:" << join(p));
      jobs.add(f.label() + " -> DCP M=" + std::to_string(m), {{"kind", "dcp"}, {"path", out.string()}, {"manifest", want}});
    }
  }
  const std::size_t checked = jobs.check(work);
  CHECK(without == 7);  // dtypes: float4 and the five bits types; big_endian_untyped: bits16
  MESSAGE(jobs.jobs.size() << " DCP outputs, " << checked << " loaded by torch 2.14");
  drop_scratch("interop-torch2-dcp");
}

TEST_CASE("a DCP checkpoint of FSDP2 with AdamW state written --to deepspeed for 1 to 3 ranks reads back as the same training state") {
  // dcp_fsdp2_w<W>: torch 2.14's dcp.save of get_state_dict(model, optimizer) as {"model", "optim",
  // "step"}: model tensors under "model.", the optimizer's keyed by the parameters' own names.
  const fs::path work = scratch("interop-torch2-dcp-deepspeed");
  std::size_t n = 0;
  for (const fixture& f : fixtures("torch2/gen_t2_dcp")) {
    if (f.name.rfind("dcp_fsdp2", 0) != 0) continue;
    CAPTURE(f.label());
    sd::formats::open_options how;
    how.with_optimizer = true;
    const sd::ShardedCheckpoint read = sd::formats::open(f.path, how).checkpoint;
    // As read, the optimizer names parameters the model holds under another name: refused, with the fix.
    sd::deepspeed::write_options w;
    w.world_size = 2;
    w.zero_stage = 2;
    std::string err;
    CHECK(statedict_test::error_of([&] { (void)sd::deepspeed::write(read, work / "refused", w); }, &err) == sd::errors::ds_write_input.id);
    CHECK(err.find("--strip-prefix model.") != std::string::npos);
    CHECK_FALSE(fs::exists(work / "refused"));
    const sd::ShardedCheckpoint src = sd::formats::rename(read, sd::formats::strip_prefix("model."));
    const auto want = sd::sha256_tensors(src);
    std::size_t moments = 0;
    for (const auto& [name, sha] : want) moments += name.rfind("optim.state.", 0) == 0 && name.find(".exp_avg") != std::string::npos ? 1U : 0U;
    CHECK(moments == 12);  // 6 parameters x exp_avg, exp_avg_sq
    std::map<std::string, sd::Value> want_values;
    for (auto& [k, v] : sd::skeleton_values(src.skeleton))
      if (k.rfind("optim.param_groups.", 0) == 0) want_values.emplace(k, v);
    for (const int stage : {1, 2, 3})
      for (const std::uint32_t m : {1U, 2U, 3U}) {
        CAPTURE(stage);
        CAPTURE(m);
        ++n;
        const fs::path out = work / (f.name + "-z" + std::to_string(stage) + "-m" + std::to_string(m));
        w.world_size = m;
        w.zero_stage = stage;
        (void)sd::deepspeed::write(src, out, w);
        sd::deepspeed::options o;
        o.with_optimizer = true;
        const sd::ShardedCheckpoint back = sd::deepspeed::describe(out, o);
        CHECK(back.format == "deepspeed_zero" + std::to_string(stage));
        // Every weight (fp32 masters), moment and step bit for bit; the step per parameter is
        // DeepSpeed's one per flat group, equal here as AdamW keeps them equal.
        const auto got = sd::sha256_tensors(back);
        CHECK(std::map<std::string, std::string>(got.begin(), got.end()) == std::map<std::string, std::string>(want.begin(), want.end()));
        std::map<std::string, sd::Value> got_values;
        for (auto& [k, v] : sd::skeleton_values(back.skeleton))
          if (k.rfind("optim.param_groups.", 0) == 0) got_values.emplace(k, v);
        CHECK(got_values == want_values);
      }
  }
  CHECK(n == 18);
  drop_scratch("interop-torch2-dcp-deepspeed");
}
