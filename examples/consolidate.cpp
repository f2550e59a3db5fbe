// The library behind `statedict convert`, in a few lines: open any checkpoint (a ZeRO, FSDP,
// DCP or ShardedTensor folder, HF shards, a .pt or .safetensors file; detected from content),
// list its consolidated tensors, write them as one safetensors file in bf16, then read a
// torch.save file without PyTorch and flatten it into named tensors.
//
//   build/bin/consolidate examples/checkpoints/zero3-tiny /tmp/model.safetensors
#include <statedict/statedict.hpp>

#include <cstdio>
#include <optional>

namespace sd = statedict;

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::fprintf(stderr, "usage: consolidate CHECKPOINT OUT.safetensors\n");
    return 2;
  }
  // Describe: reads only headers and metadata; no tensor byte is touched yet.
  sd::formats::open_options opt;
  opt.dtype = sd::dtype::BF16;  // exact round-to-nearest-even from the fp32 master weights
  const sd::formats::Opened in = sd::formats::open(argv[1], opt);
  std::printf("%s: %zu tensors\n", in.checkpoint.format.c_str(), in.checkpoint.tensors.size());
  for (const sd::TensorInfo& t : in.checkpoint.tensors)
    std::printf("  %-34s %-5s %zu dims, %zu chunk(s)\n", t.name.c_str(), std::string(sd::name(t.dtype)).c_str(),
                t.shape.size(), t.chunks.size());

  // Plan (every output element covered exactly once, proven before writing) and stream it out
  // in the format the name says: fixed memory, written under a temporary name, fsynced, renamed.
  sd::save(in.checkpoint, argv[2]);

  // The same file read back as a tree and flattened: every tensor is a zero-copy view into the
  // mapped file; copy() casts.
  const sd::FlatStateDict flat = sd::flatten(sd::load(argv[2]));
  if (const std::optional<sd::TensorView> w = flat.find("embed.weight")) {
    sd::Tensor f32(sd::dtype::F32, w->shape());
    sd::copy(*w, f32.span());  // bf16 -> f32, exact
    std::printf("embed.weight: %s, first element %g\n", std::string(sd::name(w->dtype())).c_str(),
                static_cast<double>(f32.values<float>()[0]));
  }
  return 0;
} catch (const sd::error& e) {
  std::fprintf(stderr, "consolidate: %s\n", e.what());
  return 2;
}
