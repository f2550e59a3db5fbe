#!/bin/sh
# The benchmark suite, from a fresh Debian 12 machine (run as root, or with sudo available):
#
#   ./tools/bench.sh [bench/run.py options]      (what `make bench` runs)
#
# Installs what it needs (the compilers, the libraries, PyTorch for the Python peers, matplotlib
# for the chart), then runs bench/run.py: Release build, data generation, every case.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
packages="cmake make g++ python3 nlohmann-json3-dev doctest-dev libxtensor-dev libboost1.81-dev \
libbenchmark-dev python3-torch python3-numpy python3-matplotlib"
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
exec /usr/bin/python3 "$here/bench/run.py" "$@"
