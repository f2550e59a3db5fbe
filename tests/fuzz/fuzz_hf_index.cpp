// Fuzz target: a Hugging Face index (model.safetensors.index.json, io/hf_sharded.hpp) read from
// the input, in a directory that holds three small valid shards (a.safetensors: x, y;
// b.safetensors: z and the alias t -> z; model-00001-of-00002.safetensors: w), opened,
// validated against them and described.
// SPDX-License-Identifier: MIT
#include <statedict/io/hf_sharded.hpp>
#include <statedict/formats/hf.hpp>

#include "fuzz_common.hpp"

namespace st = statedict::safetensors;
namespace hf = statedict::hf;

namespace {
const std::filesystem::path& shard_dir() {
  static const std::filesystem::path dir = [] {
    const auto d = fuzz::fresh_dir("hf");
    statedict::Tensor x(statedict::dtype::F32, {2, 3}), y(statedict::dtype::I64, {}), z(statedict::dtype::BF16, {4}),
        w(statedict::dtype::U8, {0});
    st::Input ins_a[] = {st::Input::of("x", x.view()), st::Input::of("y", y.view())};
    st::write(d / "a.safetensors", ins_a);
    st::Input ins_b[] = {st::Input::of("z", z.view())};
    st::write_options wb;
    wb.aliases = {{"t", "z"}};
    wb.metadata = std::map<std::string, std::string>{{"format", "pt"}};
    st::write(d / "b.safetensors", ins_b, wb);
    st::Input ins_c[] = {st::Input::of("w", w.view())};
    st::write(d / "model-00001-of-00002.safetensors", ins_c);
    return d;
  }();
  return dir;
}
}  // namespace

STATEDICT_FUZZ_TARGET(data, size) {
  const auto& dir = shard_dir();
  if (!fuzz::write_file(dir / hf::index_name, fuzz::bytes_of(data, size))) return 0;
  hf::open_options opt;
  opt.max_index_bytes = 1 << 20;
  opt.lim.max_header_bytes = 1 << 20;
  try {
    const hf::Checkpoint c = hf::Checkpoint::open(dir, opt);
    for (const auto& item : c.items()) (void)c.sha256(item.name);
    (void)c.to_flat_dict();
    (void)c.describe();
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
