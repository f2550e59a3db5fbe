#!/bin/sh
# The whole test suite, from a fresh Debian 12 machine (run as root, or with sudo available):
#
#   ./tools/test.sh
#
# Installs what it needs, then:
#   1. checks that single_include/ is up to date, that error ids are unique and documented, and
#      that the pages quoting scripts (docs/slurm.md) quote them as they are;
#   2. builds everything with g++ (warnings are errors) and runs the suite, including the interop
#      tests against real PyTorch (Debian 12's 1.13, and 2.x from a Debian sid root that
#      tools/sid-root.sh builds once per machine) and the CMake consumer projects;
#   3. runs the job scripts of docs/slurm.md under a real single-node Slurm, torchrun and MPI;
#   4. builds with clang and -fsanitize=address,undefined and runs the suite again;
#   5. builds the unit tests against the single header in a Release build (-O2) and runs them;
#   6. builds the libFuzzer targets (clang, ASan + UBSan) and runs each for a while.
# STATEDICT_STAGES picks stages (default "check gcc slurm asan single fuzz"); STATEDICT_FUZZ_SECONDS sets
# the time per fuzzer (default 12), STATEDICT_FUZZ_SEED its libFuzzer seed (default 1, so that a
# red fuzz stage replays; 0 for a random one). Build trees go under build/.
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
stages=${STATEDICT_STAGES:-check gcc slurm asan single fuzz}
fuzz_seconds=${STATEDICT_FUZZ_SECONDS:-12}
fuzz_seed=${STATEDICT_FUZZ_SEED:-1}
jobs=${STATEDICT_JOBS:-$(nproc)}

packages="cmake make g++ clang python3 nlohmann-json3-dev zlib1g-dev doctest-dev libxtensor-dev libboost1.81-dev \
libbenchmark-dev python3-torch python3-numpy libfuzzer-14-dev libclang-rt-14-dev debootstrap doxygen"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "== installing:$missing"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y $packages
fi

stage() { case " $stages " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
t0=$(date +%s)
elapsed() { echo "   ($(( $(date +%s) - t0 )) s so far)"; }

# Test builds are optimized lightly and without full debug information: a header-only library
# compiles every inline function it uses in every test, and -O2 -g doubles the time of the stage
# for no gain in what the tests check (clang builds keep line tables for sanitizer reports).
run_suite() {  # name, build dir, optimization flags, cmake options...
  name=$1 dir=$2 opt_flags=$3
  shift 3
  echo "== $name: configure + build ($dir)"
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=CI "-DCMAKE_CXX_FLAGS_CI=$opt_flags" -DSTATEDICT_WERROR=ON \
    -DSTATEDICT_FIXTURE_DIR="$here/build/fixtures" "$@" \
    >"$dir.configure.log" 2>&1 || {
    cat "$dir.configure.log"
    exit 1
  }
  cmake --build "$dir" -j "$jobs"
  echo "== $name: test"
  (cd "$dir" && ctest -j "$jobs" --output-on-failure --timeout 1200)
  elapsed
}

mkdir -p build
if stage check; then
  echo "== check: single header, error ids, documentation snippets and reference"
  python3 tools/amalgamate.py --check
  python3 tools/check_error_ids.py
  python3 tools/doc_includes.py --check
  python3 tools/reference.py --check
fi
if stage gcc; then
  # Today's PyTorch (2.x with safetensors, transformers, huggingface_hub) from a Debian sid root,
  # built once per machine and cached outside the clone (/var/cache/statedict/sid-root): the
  # fixtures and the oracle of tests/interop-torch2.cpp and tests/interop-corpus.cpp.
  echo "== gcc: the Debian sid root with PyTorch 2.x (tools/sid-root.sh: minutes the first time on a machine, then cached)"
  t_root=$(date +%s)
  tools/sid-root.sh
  echo "   sid root ready in $(( $(date +%s) - t_root )) s"
  CXX=g++ run_suite "g++" build/gcc "-O1"
fi
if stage slurm; then
  echo "== slurm: the job scripts of docs/slurm.md under a real Slurm, torchrun, Open MPI and MPICH"
  if [ ! -x build/gcc/bin/statedict ]; then
    CXX=g++ cmake -S . -B build/gcc -DCMAKE_BUILD_TYPE=CI "-DCMAKE_CXX_FLAGS_CI=-O1" -DSTATEDICT_WERROR=ON >build/gcc.configure.log 2>&1 || {
      cat build/gcc.configure.log
      exit 1
    }
    cmake --build build/gcc -j "$jobs" --target statedict_cli
  fi
  tests/slurm/run.sh build/gcc
  elapsed
fi
if stage asan; then
  # Sanitized builds abort on the first report; detect_leaks catches leaks too. At -O0: clang
  # compiles a test batch with ASan + UBSan about three times faster than at -O1, which outweighs
  # the slower tests. The examples are not built: this stage does not run them (cli-examples).
  # Nor is the separately compiled library: it is the same code, built and linked by the g++ stage.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    CXX=clang++ run_suite "clang + ASan/UBSan" build/asan "-O0 -gline-tables-only" -DSTATEDICT_SANITIZE=ON \
    -DSTATEDICT_TEST_CONSUMERS=OFF -DSTATEDICT_BUILD_EXAMPLES=OFF -DSTATEDICT_BUILD_COMPILED=OFF
fi
fuzz_build() {
  CXX=clang++ cmake -S . -B build/fuzz -DCMAKE_BUILD_TYPE=CI "-DCMAKE_CXX_FLAGS_CI=-O1 -gline-tables-only" -DSTATEDICT_BUILD_FUZZERS=ON \
    -DSTATEDICT_BUILD_TESTS=OFF -DSTATEDICT_BUILD_EXAMPLES=OFF -DSTATEDICT_BUILD_CLI=OFF -DSTATEDICT_BUILD_COMPILED=OFF \
    -DSTATEDICT_WERROR=ON && cmake --build build/fuzz -j "$jobs"
}
fuzz_pid=""
run_fuzz=""
stage fuzz && [ -f tests/fuzz/CMakeLists.txt ] && run_fuzz=1
if [ -n "$run_fuzz" ] && stage single; then
  # The single-header build spends minutes on one translation unit while the other core idles;
  # the fuzzers' build fills it.
  echo "== fuzz: build (clang, libFuzzer, ASan + UBSan), beside the single-header stage: build/fuzz.build.log"
  fuzz_build >build/fuzz.build.log 2>&1 &
  fuzz_pid=$!
fi
if stage single; then
  CXX=g++ run_suite "single header, Release" build/single "-O2 -DNDEBUG" -DSTATEDICT_TEST_SINGLE_HEADER=ON -DSTATEDICT_BUILD_EXAMPLES=OFF \
    -DSTATEDICT_BUILD_CLI=OFF -DSTATEDICT_BUILD_COMPILED=OFF -DSTATEDICT_TEST_CONSUMERS=OFF
fi
if [ -n "$run_fuzz" ]; then
  if [ -n "$fuzz_pid" ]; then
    echo "== fuzz: waiting for the build"
    wait "$fuzz_pid" || {
      tail -n 100 build/fuzz.build.log
      exit 1
    }
  else
    echo "== fuzz: build (clang, libFuzzer, ASan + UBSan)"
    fuzz_build
  fi
  python3 tests/fuzz/run_all.py --build build/fuzz --seconds "$fuzz_seconds" --jobs "$jobs" --seed "$fuzz_seed"
  elapsed
fi
echo "== all stages passed: $stages"
