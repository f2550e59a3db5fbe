// Uses the installed headers to write a checkpoint, then the installed tool to inspect it.
#include <statedict/statedict.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

int main() {
  namespace sd = statedict;
  const sd::Value v = sd::Dict{{"w", sd::Tensor::from<float>({1, 2}, {2})}, {"step", 3}};
  if (v["step"].as_int() != 3 || v["w"].as_tensor().numel() != 2) return 1;
  const auto path = std::filesystem::temp_directory_path() / "statedict-consumer.safetensors";
  (void)sd::safetensors::write_state(path, v);
  const std::string cmd = std::string(STATEDICT_EXE) + " inspect --json '" + path.string() + "'";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return 2;
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int rc = ::pclose(p);
  std::filesystem::remove(path);
  const bool ok = rc == 0 && out.find("\"w\"") != std::string::npos && out.find("\"step\": 3") != std::string::npos;
  if (!ok) std::fprintf(stderr, "installed statedict inspect printed:\n%s\n", out.c_str());
  return ok ? 0 : 3;
}
