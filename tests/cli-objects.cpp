// Files other projects' tools wrote, and checkpoints that pickle objects beyond torch.load's
// weights_only allow-list, end to end with the `statedict` tool and PyTorch as the oracle:
// - tests/data/corpus: every file PyTorch reads, statedict reads bit-exact (inspect --hash
//   against the manifests PyTorch wrote), and converted to .safetensors and back to .pt it
//   loads in torch.load equal to the manifest (tests/python/corpus_check.py), with PyTorch 1.13
//   and, where the Debian sid root exists (tools/sid-root.sh), PyTorch 2.x;
// - fairseq-, metaseq- and Megatron-shaped checkpoints (Namespace args with a torch dtype and an
//   enum, numpy RNG states and scalars, meters, optimizer state, nested models) at protocols 2
//   and 4 and in the legacy format: read, converted, and loaded back as their data, the outputs'
//   pickles naming no global but torch's own (tests/python/objects_check.py shaped); with
//   PyTorch 2.x with weights_only=True and mmap=True;
// - with PyTorch 2.x, the objects fixtures of tests/python/torch2/gen_t2_objects.py (numpy
//   arrays of every layout, sparse, quantized, Parameters with attributes) and the legacy files
//   of gen_t2_torch.py at pickle protocols 0-5 (objects_check.py t2).
#include "cli_util.hpp"

using namespace cli_test;

namespace {

const fs::path corpus = source_dir / "tests" / "data" / "corpus";
const fs::path checker_dir = source_dir / "tests" / "python";

/// The sid root when it has been built (its stamp written last); the tests never build it.
bool have_sid_root() {
  const run_result r = run({(source_dir / "tools" / "sid-root.sh").string(), "--print-root"});
  if (r.code != 0) return false;
  std::string root = r.out;
  while (!root.empty() && (root.back() == '\n' || root.back() == ' ')) root.pop_back();
  return !root.empty() && fs::exists(fs::path(root) / "statedict-sid-root.stamp");
}

/// Runs a checker; each line it prints is a difference.
void expect_agreement(const std::vector<std::string>& argv) {
  const run_result r = run(argv);
  INFO(r.describe());
  for (const std::string& l : lines(r.out)) FAIL_CHECK(l);
  CHECK(r.code == 0);
}

}  // namespace

TEST_CASE("the real-world corpus: read bit-exact, and converted back to .pt it loads equal in PyTorch 1.13") {
  const fs::path work = scratch("corpus-113");
  expect_agreement({python, (checker_dir / "corpus_check.py").string(), "--statedict", cli_path, corpus.string(), "--roundtrip",
                    "--workdir", work.string()});
  drop_scratch("corpus-113");
}

TEST_CASE("fairseq-, metaseq- and Megatron-shaped checkpoints convert, and load as their data in PyTorch 1.13") {
  const fs::path work = scratch("shaped-113");
  expect_agreement({python, (checker_dir / "objects_check.py").string(), "shaped", cli_path, work.string()});
  drop_scratch("shaped-113");
}

TEST_CASE("PyTorch 2.x: the corpus, the shaped checkpoints with weights_only=True and mmap=True, objects and legacy fixtures") {
  if (!have_sid_root()) {
    MESSAGE("the Debian sid root (tools/sid-root.sh) is not built: the PyTorch 2.x checks did not run");
    return;
  }
  const std::string sid = (source_dir / "tools" / "sid-python").string();
  const fs::path work = scratch("torch2");
  expect_agreement({sid, (checker_dir / "corpus_check.py").string(), "--statedict", cli_path, corpus.string(), "--roundtrip",
                    "--workdir", (work / "corpus").string()});
  expect_agreement({sid, (checker_dir / "objects_check.py").string(), "shaped", cli_path, (work / "shaped").string()});
  for (const char* gen : {"gen_t2_objects", "gen_t2_torch"}) {
    CAPTURE(gen);
    const fs::path fix = work / gen;
    const run_result g = run({sid, (checker_dir / "torch2" / (std::string(gen) + ".py")).string(), fix.string()});
    REQUIRE_MESSAGE(g.code == 0, g.describe());
    expect_agreement({sid, (checker_dir / "objects_check.py").string(), "t2", cli_path, fix.string(), (work / (std::string(gen) + ".out")).string()});
  }
  drop_scratch("torch2");
}

TEST_CASE("convert says once per class what became data; --keep-class writes a class as itself") {
  const fs::path work = scratch("keep-class");
  const fs::path src = work / "fairseq.pt";
  const run_result g = run({python, "-c",
                            "import sys, argparse, torch; sys.path.insert(0, " + json(checker_dir.string()).dump() + ")\n"
                            "import _shapes\n"
                            "torch.save({'args': argparse.Namespace(lr=0.1, arch='lm', precision=_shapes.Precision.BF16), "
                            "'w': torch.ones(2), 'meters': [_shapes.AverageMeter(1.0, 2), _shapes.AverageMeter(2.0, 1)]}, " +
                                json(src.string()).dump() + ")"});
  REQUIRE_MESSAGE(g.code == 0, g.describe());
  const run_result a = cli({"convert", src.string(), (work / "data.pt").string()});
  REQUIRE_MESSAGE(a.code == 0, a.describe());
  const auto err = lines(a.err);
  const auto count = [&](const std::string& cls) {
    return std::count_if(err.begin(), err.end(), [&](const std::string& l) { return l.rfind("statedict: " + cls + ":", 0) == 0; });
  };
  CHECK(count("argparse.Namespace") == 1);
  CHECK(count("_shapes.AverageMeter") == 1);  // two objects, one line
  CHECK(std::any_of(err.begin(), err.end(), [](const std::string& l) { return l.find("_shapes.AverageMeter: 2 objects written as the dict of its attributes") != std::string::npos; }));
  const run_result b = cli({"convert", src.string(), (work / "kept.pt").string(), "--keep-class", "argparse.Namespace"});
  REQUIRE_MESSAGE(b.code == 0, b.describe());
  CHECK(b.err.find("argparse.Namespace:") == std::string::npos);
  const run_result c = cli({"convert", src.string(), (work / "x.pt").string(), "--keep-class", "Namespace"});
  CHECK(c.code == 2);
  CHECK(c.err.find("[statedict.usage_error.802]") != std::string::npos);  // cli.bad_value
  // What torch.load gives back: the data, and the kept class as itself.
  const run_result l = run({python, "-c",
                            "import sys, torch; sys.path.insert(0, " + json(checker_dir.string()).dump() + ")\n"
                            "d = torch.load(" + json((work / "data.pt").string()).dump() + ")\n"
                            "k = torch.load(" + json((work / "kept.pt").string()).dump() + ")\n"
                            "print(type(d['args']).__name__, d['args']['lr'], type(d['meters'][0]).__name__, type(k['args']).__name__)"});
  REQUIRE_MESSAGE(l.code == 0, l.describe());
  CHECK(lines(l.out).back() == "dict 0.1 dict Namespace");
  // inspect spells the object as Python would.
  const run_result i = cli({"inspect", src.string()});
  REQUIRE(i.code == 0);
  CHECK(i.out.find("args = argparse.Namespace(lr=0.1, arch='lm', precision=") != std::string::npos);
  drop_scratch("keep-class");
}
