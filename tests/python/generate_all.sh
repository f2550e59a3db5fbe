#!/bin/sh
# Generates every test fixture with real PyTorch into $1 (idempotent per build directory).
set -eu
out=${1:?usage: generate_all.sh OUTDIR}
py=${STATEDICT_PYTHON:-/usr/bin/python3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for gen in "$here"/gen_*.py; do
  [ -f "$gen" ] || continue
  name=$(basename "$gen" .py)
  stamp="$out/.$name.stamp"
  if [ -f "$stamp" ] && [ "$stamp" -nt "$gen" ]; then continue; fi
  echo "generating $name"
  mkdir -p "$out/$name"
  "$py" "$gen" "$out/$name"
  touch "$stamp"
done
