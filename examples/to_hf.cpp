// A training checkpoint to Hugging Face shards: the wrapper prefix goes, two names get the names a
// model class expects, floating tensors become BF16, and the result is split into shards with an
// index. Nothing is read until the shards are written (streamed, in fixed memory); ties such as a
// tied output head stay ties, and values that are not tensors travel in the shards' metadata.
//
//   build/bin/to_hf examples/checkpoints/zero3-tiny /tmp/hf          # a DeepSpeed ZeRO folder
//   build/bin/to_hf ckpt.pt /tmp/hf model                            # only ckpt["model"], unwrapped
#include <statedict/statedict.hpp>

#include <cstdio>
#include <string>

namespace sd = statedict;

int main(int argc, char** argv) try {
  if (argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: to_hf INPUT OUTPUT_DIR [PREFIX]\n");
    return 2;
  }
  const std::string prefix = argc == 4 ? argv[3] : "module";

  sd::convert_options opt;
  opt.input.dtype = sd::dtype::BF16;  // floating tensors only; integer buffers keep their dtype
  if (argc == 4) opt.transforms.push_back(sd::selected({prefix}));
  opt.transforms.push_back(sd::renamed(sd::formats::then(
      sd::formats::strip_prefix(prefix + "."),
      sd::formats::rename_map({{"embed.weight", "model.embed_tokens.weight"}, {"head.weight", "lm_head.weight"}}))));
  opt.output.format = "hf";
  opt.output.max_shard_size = 4096;  // tiny shards, to show the index

  const sd::conversion done = sd::convert(argv[1], argv[2], opt);
  std::printf("%s (%s) -> %zu tensors, %llu bytes in", done.input_format.c_str(), done.rule.c_str(), done.tensors,
              static_cast<unsigned long long>(done.bytes));
  for (const std::string& f : done.files) std::printf(" %s", f.c_str());
  std::printf("\n");

  // The shards as a loader sees them: names, dtypes, and the ties recorded beside the tensors.
  const sd::Opened out = sd::open(argv[2]);
  for (const sd::TensorInfo& t : out.checkpoint.tensors)
    std::printf("  %-28s %s\n", t.name.c_str(), std::string(sd::name(t.dtype)).c_str());
  for (const sd::formats::Tie& tie : sd::formats::tied_names(out.checkpoint.skeleton))
    std::printf("  %-28s tied to %s\n", tie.name.c_str(), tie.target.c_str());
  return 0;
} catch (const sd::error& e) {
  std::fprintf(stderr, "to_hf: %s\n", e.what());
  return 1;
}
