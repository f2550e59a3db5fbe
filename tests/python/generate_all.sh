#!/bin/sh
# Generates every test fixture with real PyTorch into $1, one subfolder per tests/python/gen_*.py.
# A generator runs again when any Python file under tests/python/ is newer than its stamp (so an
# edit to a shared helper module regenerates what depends on it).
set -eu
out=${1:?usage: generate_all.sh OUTDIR}
py=${STATEDICT_PYTHON:-/usr/bin/python3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for gen in "$here"/gen_*.py; do
  [ -f "$gen" ] || continue
  name=$(basename "$gen" .py)
  stamp="$out/.$name.stamp"
  if [ -f "$stamp" ] && [ -z "$(find "$here" -name '*.py' -newer "$stamp" | head -n 1)" ]; then
    continue
  fi
  echo "generating $name"
  rm -rf "$out/$name"
  mkdir -p "$out/$name"
  "$py" "$gen" "$out/$name"
  touch "$stamp"
done
