// Optimizer surgery on a flat state dict: the vocabulary of a trained model grows by some rows,
// and its checkpoint (model and AdamW state, as torch.save wrote them) must follow. The embedding
// gets new rows (the mean of the old ones), its Adam moments zero rows, everything else (the tied
// output head, the other parameters' state, the step counts, the hyper-parameters) stays as it was.
// The tensors that do not change are never copied: they stay views into the mapped input.
//
//   build/bin/optimizer_surgery ckpt.pt grown.pt 12 emb.weight blocks.0.fc.weight ...
//     (the new number of rows, then the parameter names in the order the optimizer lists them)
#include <statedict/statedict.hpp>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace sd = statedict;

namespace {

// Replaces the F32 tensor `name` of `flat` by one with `rows` rows: its rows first, then new rows
// (zeros, or the mean of the old rows).
void grow(sd::FlatStateDict& flat, const std::string& name, std::size_t rows, bool mean) {
  if (const std::optional<sd::TensorView> view = flat.find(name)) {
    const sd::Tensor old = sd::Tensor::copy_of(*view, sd::dtype::F32);
    const std::span<const float> src = old.values<float>();
    const std::size_t old_rows = static_cast<std::size_t>(old.shape()[0]), cols = src.size() / old_rows;
    sd::shape_t shape = old.shape();
    shape[0] = static_cast<sd::dim_t>(rows);
    sd::Tensor grown = sd::Tensor::zeros(sd::dtype::F32, shape);
    const std::span<float> dst = grown.values<float>();
    std::copy(src.begin(), src.end(), dst.begin());
    for (std::size_t c = 0; mean && c < cols; ++c) {
      double sum = 0;
      for (std::size_t r = 0; r < old_rows; ++r) sum += static_cast<double>(src[r * cols + c]);
      for (std::size_t r = old_rows; r < rows; ++r) dst[r * cols + c] = static_cast<float>(sum / static_cast<double>(old_rows));
    }
    flat.replace(name, grown.view());  // the view keeps the new buffer alive; ties follow
    return;
  }
  throw std::runtime_error("no tensor named " + name);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 5) {
    std::fprintf(stderr, "usage: optimizer_surgery IN.pt OUT.pt ROWS PARAM_NAME...\n");
    return 2;
  }
  const std::size_t rows = std::strtoull(argv[3], nullptr, 10);
  const std::vector<std::string> params(argv + 4, argv + argc);

  const sd::Value ckpt = sd::load(argv[1]);                     // mapped, zero-copy
  sd::FlatStateDict model = sd::flatten(ckpt["model"]);
  sd::FlatStateDict optim = sd::optim::by_name(sd::flatten(ckpt["optim"]), params);

  grow(model, "emb.weight", rows, /*mean=*/true);
  grow(optim, "state.emb.weight.exp_avg", rows, false);
  grow(optim, "state.emb.weight.exp_avg_sq", rows, false);

  sd::Dict out = ckpt.as_dict();  // epoch, loss, ... as they were
  out.set("model", sd::unflatten(model));
  out.set("optim", sd::unflatten(sd::optim::by_id(optim)));
  sd::save(sd::Value(std::move(out)), argv[2]);

  const sd::FlatStateDict check = sd::flatten(sd::load(argv[2]));
  std::printf("model.emb.weight %s, model.head.weight %s (tied), optim.state.0.exp_avg %s\n",
              sd::to_string(check.find("model.emb.weight")->shape()).c_str(),
              sd::to_string(check.find("model.head.weight")->shape()).c_str(),
              sd::to_string(check.find("optim.state.0.exp_avg")->shape()).c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "optimizer_surgery: %s\n", e.what());
  return 1;
}
