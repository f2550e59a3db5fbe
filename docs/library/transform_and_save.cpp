// Rename, drop, cast, split and save: transforms change the description (names, dtypes, which
// bytes make which tensor), save() streams the bytes once. Ties and values follow the names.
#include <statedict/formats/transform_regex.hpp>
#include <statedict/statedict.hpp>

#include <cstdio>
#include <filesystem>

namespace sd = statedict;
namespace f = statedict::formats;

int main() {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "statedict-doc-transform";
  fs::remove_all(dir);
  fs::create_directories(dir);

  // A training checkpoint: a wrapper prefix, a fused QKV projection, a tied head, a step count.
  const sd::Tensor embed = sd::Tensor::from<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  sd::Dict model{{"embed.weight", embed},
                 {"attn.qkv.weight", sd::Tensor::from<float>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {6, 2})},
                 {"head.weight", embed},  // the same tensor: a tie
                 {"step", 1000}};
  sd::save(sd::Dict{{"module", sd::Value(std::move(model))}}, dir / "train.pt");

  sd::ShardedCheckpoint ck = sd::open(dir / "train.pt").checkpoint;
  ck = f::rename(ck, f::strip_prefix("module."));                                   // module.x -> x
  ck = f::rename(ck, f::rename_regex(R"(attn\.(\w+)\.weight)", "layers.0.attn.$1.weight"));
  ck = f::split(ck, "layers.0.attn.qkv.weight", 0,
                {{"layers.0.attn.q.weight", 2}, {"layers.0.attn.k.weight", 2}, {"layers.0.attn.v.weight", 2}});
  ck = f::drop(ck, [](std::string_view n) { return n == "step"; });
  f::cast(ck, sd::dtype::BF16);

  // Hugging Face shards: model.safetensors.index.json and the shard files, written atomically.
  sd::formats::save_options hf;
  hf.format = "hf";
  hf.max_shard_size = 16;  // bytes: a tiny model still makes several shards
  const auto files = sd::save(ck, dir / "hf", hf);
  std::printf("%zu files:", files.size());
  for (const auto& file : files) std::printf(" %s", file.c_str());
  std::printf("\n");

  const sd::Opened out = sd::open(dir / "hf");
  const sd::Tensor v = sd::read_tensor(out.checkpoint, "layers.0.attn.v.weight", sd::dtype::F32);
  std::printf("layers.0.attn.v.weight = [%g, %g, %g, %g]\n", static_cast<double>(v.values<float>()[0]),
              static_cast<double>(v.values<float>()[1]), static_cast<double>(v.values<float>()[2]),
              static_cast<double>(v.values<float>()[3]));
  const bool tied = !f::tied_names(out.checkpoint.skeleton).empty();
  fs::remove_all(dir);
  return v.values<float>()[0] == 9.0F && tied ? 0 : 1;
}
