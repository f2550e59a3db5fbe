// Open a checkpoint of any layout and read from it piece by piece: one tensor, some rows of
// another into a buffer of the caller's, without reading the rest.
#include <statedict/statedict.hpp>

#include <cstdio>
#include <filesystem>
#include <vector>

namespace sd = statedict;

int main() {
  const std::filesystem::path path = std::filesystem::temp_directory_path() / "statedict-doc-open.safetensors";
  sd::save(sd::Dict{{"embed.weight", sd::Tensor::from<float>({0, 1, 2, 3, 4, 5, 6, 7}, {4, 2})},
                    {"head.bias", sd::Tensor::from<float>({0.5F, -0.5F}, {2})}},
           path);

  // Metadata only: names, dtypes, shapes and where every element's bytes are.
  const sd::Opened in = sd::open(path);
  std::printf("%s (%s)\n", in.checkpoint.format.c_str(), in.rule.c_str());
  for (const sd::TensorInfo& t : in.checkpoint.tensors)
    std::printf("  %s %s %s\n", t.name.c_str(), std::string(sd::name(t.dtype)).c_str(), sd::to_string(t.shape).c_str());

  // One tensor, in a dtype of the caller's choice.
  const sd::Tensor bias = sd::read_tensor(in.checkpoint, "head.bias", sd::dtype::F64);
  // Rows [1, 3) of another, into the caller's memory.
  std::vector<float> rows(4);
  sd::read_rows(in.checkpoint, "embed.weight", 1, 3, std::as_writable_bytes(std::span(rows)));
  std::printf("head.bias[1] = %g, embed.weight[1:3] = %g %g %g %g\n", bias.values<double>()[1], static_cast<double>(rows[0]),
              static_cast<double>(rows[1]), static_cast<double>(rows[2]), static_cast<double>(rows[3]));
  std::filesystem::remove(path);
  return rows[0] == 2.0F && rows[3] == 5.0F && bias.values<double>()[1] == -0.5 ? 0 : 1;
}
