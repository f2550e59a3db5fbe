#!/bin/sh
# The main job on a bundled example, from a fresh Debian 12 machine (run as root, or with sudo):
#
#   ./tools/demo.sh
#
# Installs the build tools if they are missing, builds build/bin/statedict, then consolidates the
# bundled DeepSpeed ZeRO-3 checkpoint (examples/checkpoints/zero3-tiny: 4 ranks, bf16 weights,
# fp32 master partitions and Adam moments, a tied embedding, a frozen layer) into one
# .safetensors file, inspects the result, checks it against the sharded input with `verify`, and
# checks every tensor's SHA-256 against the manifest written when the example was made.
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
packages="cmake make g++ python3 nlohmann-json3-dev"
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

echo "== building build/bin/statedict"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSTATEDICT_BUILD_TESTS=OFF >.demo-configure.log 2>&1 || {
  cat .demo-configure.log
  exit 1
}
rm -f .demo-configure.log
cmake --build build -j "$(nproc)" --target statedict_cli
statedict=build/bin/statedict
ckpt=examples/checkpoints/zero3-tiny
out=build/demo/model.safetensors

echo
echo "== $statedict inspect $ckpt"
$statedict inspect "$ckpt"
echo
echo "== $statedict convert $ckpt $out"
$statedict convert "$ckpt" "$out"
echo
echo "== $statedict inspect $out"
$statedict inspect "$out"
echo
echo "== $statedict verify $ckpt $out"
$statedict verify "$ckpt" "$out"
echo
echo "== every tensor's SHA-256 against examples/checkpoints/zero3-tiny.manifest.json"
$statedict inspect "$out" --json --hash >build/demo/inspect.json
python3 - build/demo/inspect.json examples/checkpoints/zero3-tiny.manifest.json <<'PY'
import json, sys
got = json.load(open(sys.argv[1]))["tensors"]
want = json.load(open(sys.argv[2]))["tensors"]
bad = [n for n in want if n not in got or any(got[n][k] != want[n][k] for k in ("dtype", "shape", "sha256"))]
extra = [n for n in got if n not in want]
if bad or extra:
    sys.exit(f"MISMATCH: {bad} missing/different, {extra} unexpected")
print(f"all {len(want)} tensors match the manifest bit for bit")
PY
