// A format of the program's own, registered at run time: a directory of raw little-endian tensor
// files (numpy's tofile) listed in a tensors.json. open() detects it like a built-in layout, and
// every writer, transform and reader of the library works on it.
#include <statedict/statedict.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace sd = statedict;
namespace fs = std::filesystem;

class raw_dir final : public sd::formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "raw_dir"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "directory of raw tensor files with a tensors.json"; }

  [[nodiscard]] sd::formats::Detection detect(const sd::formats::Input& in, const sd::formats::open_options& /*opt*/) const override {
    if (!in.is_directory()) return sd::formats::Detection::not_applicable();
    if (!fs::is_regular_file(in.path() / "tensors.json")) return sd::formats::Detection::miss("raw_dir: no tensors.json");
    return sd::formats::Detection::match("raw_dir: a tensors.json");
  }

  [[nodiscard]] sd::ShardedCheckpoint describe(const sd::formats::Input& in, const sd::formats::open_options& /*opt*/) const override {
    std::ifstream index_file(in.path() / "tensors.json");
    const nlohmann::json index = nlohmann::json::parse(index_file);
    sd::ShardedCheckpoint ck;
    ck.format = "raw_dir";
    for (const auto& [tensor, t] : index.items()) {
      sd::TensorInfo info;
      info.name = tensor;
      const auto dtype = sd::dtype_from_name(t.at("dtype").get<std::string>());
      if (!dtype) throw std::runtime_error("tensors.json: tensor '" + tensor + "' has an unknown dtype");
      info.dtype = *dtype;
      info.shape = sd::shape_t(t.at("shape").get<std::vector<sd::dim_t>>());
      auto file = sd::InputFile::open(in.path() / t.at("file").get<std::string>(), in.mode());
      // Input is hostile: the file must hold exactly the tensor's bytes.
      if (file->size() != sd::byte_size(info.shape, sd::itemsize(info.dtype)))
        throw std::runtime_error("tensors.json: tensor '" + tensor + "' does not match the size of its file");
      // One chunk: every element, row-major, from byte 0 of its file.
      const auto source = static_cast<std::uint32_t>(ck.sources.size());
      info.chunks.push_back({sd::FlatRange{0, sd::numel(info.shape)}, sd::Placement{source, 0, {}, info.dtype}});
      ck.sources.push_back(std::move(file));
      ck.tensors.push_back(std::move(info));
    }
    return ck;
  }
};

int main() {
  const fs::path dir = fs::temp_directory_path() / "statedict-doc-raw";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  std::ofstream(dir / "w.bin", std::ios::binary).write(reinterpret_cast<const char*>(w.data()), 24);  // NOLINT
  std::ofstream(dir / "tensors.json") << R"({"w": {"dtype": "F32", "shape": [2, 3], "file": "w.bin"}})";

  sd::formats::add_format(std::make_shared<raw_dir>());
  const sd::Opened in = sd::open(dir);
  std::printf("%s: %s\n", std::string(in.format->name()).c_str(), in.rule.c_str());
  sd::save(in.checkpoint, dir / "model.safetensors");

  const sd::Tensor back = sd::read_tensor(sd::open(dir / "model.safetensors").checkpoint, "w");
  std::printf("w[1, 2] = %g\n", static_cast<double>(back.values<float>()[5]));
  fs::remove_all(dir);
  return back.values<float>()[5] == 6.0F ? 0 : 1;
}
