#!/bin/sh
# Generates the torch 2.x fixtures into $1, one subfolder per tests/python/torch2/gen_t2_*.py, with
# the Debian sid root's PyTorch (tools/sid-python; the root is built first when missing, which
# takes minutes once per machine). A generator runs again when a Python file here or
# tests/python/_common.py (which _t2.py builds on) is newer than its stamp, or when the sid root
# was rebuilt since.
set -eu
out=${1:?usage: generate_all.sh OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
"$repo/tools/sid-root.sh" >/dev/null
root=$("$repo/tools/sid-root.sh" --print-root)
mkdir -p "$out"
out=$(cd "$out" && pwd)
for gen in "$here"/gen_t2_*.py; do
  [ -f "$gen" ] || continue
  name=$(basename "$gen" .py)
  stamp="$out/.$name.stamp"
  if [ -f "$stamp" ] && [ -z "$(find "$here" "$here/../_common.py" -name '*.py' -newer "$stamp" | head -n 1)" ] &&
     [ ! "$root/statedict-sid-root.stamp" -nt "$stamp" ]; then
    continue
  fi
  echo "generating torch2/$name"
  rm -rf "$out/$name"
  mkdir -p "$out/$name"
  "$repo/tools/sid-python" "$gen" "$out/$name" 2>"$out/.$name.log" || {
    cat "$out/.$name.log" >&2
    exit 1
  }
  touch "$stamp"
done
