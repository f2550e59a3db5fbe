// A program built against statedict::compiled (STATEDICT_SEPARATE_COMPILATION): this translation
// unit and facade-b.cpp include only the declarations of the facade, the library's definitions
// come from the archive. The test fails to link if a facade function is declared but not compiled
// into the archive, and fails to compile if api.hpp needs a header that defines functions.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#ifndef STATEDICT_DECLARATIONS_ONLY
#error "this test must be built in separate-compilation mode"
#endif

#include <filesystem>
#include <string>

std::filesystem::path write_model(const std::filesystem::path& dir);  // facade-b.cpp

TEST_CASE("separate compilation: open, transform, save, read and compare through the archive") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "statedict-separate-test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path pt = write_model(dir);

  statedict::Opened in = statedict::open(pt);
  CHECK(in.format->name() == "torch");
  statedict::ShardedCheckpoint ck = statedict::formats::rename(in.checkpoint, statedict::formats::strip_prefix("module."));
  statedict::formats::cast(ck, statedict::dtype::BF16);
  const auto files = statedict::save(ck, dir / "out.safetensors");
  REQUIRE(files.size() == 1);

  statedict::Opened back = statedict::open(dir / "out.safetensors");
  const statedict::Tensor w = statedict::read_tensor(back.checkpoint, "layer.weight", statedict::dtype::F32);
  CHECK(w.shape() == statedict::shape_t{2, 3});
  CHECK(w.values<float>()[5] == 5.0F);
  CHECK(statedict::compare(ck, back.checkpoint).equal());

  statedict::convert_options opt;
  opt.transforms.push_back([](const statedict::ShardedCheckpoint& c) {
    return statedict::formats::drop(c, [](std::string_view n) { return n.ends_with(".bias"); });
  });
  opt.output.format = "hf";
  const statedict::conversion done = statedict::convert(pt, dir / "hf", opt);
  CHECK(done.input_format == "torch");
  CHECK(done.output_format == "hf");
  CHECK(done.tensors == 1);
  CHECK(statedict::open(dir / "hf").checkpoint.tensors.size() == 1);

  const statedict::Value tree = statedict::load(dir / "out.safetensors");
  const statedict::FlatStateDict flat = statedict::flatten(tree);
  CHECK(flat.find("layer.bias") != nullptr);
  fs::remove_all(dir);
}
