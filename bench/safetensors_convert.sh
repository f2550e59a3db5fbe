#!/bin/sh
# Streams a large safetensors file through statedict's writer (as `statedict convert` does) and
# compares the time with `cp` of the same file in the same run; reports peak anonymous memory.
#
#   bench/safetensors_convert.sh BUILD_DIR [GIB=3] [RUNS=3]
#
# BUILD_DIR is a Release build with -DSTATEDICT_BUILD_BENCH=ON (it provides bin/bench-safetensors,
# whose --make and --convert modes do the work). The input is generated once per run in $TMPDIR
# and read once before timing, so every contender starts from the same warm page cache. statedict
# fsyncs its output before renaming it into place (atomic output), so `cp` is timed both alone and
# followed by `sync FILE` (the like-for-like figure). Times are the best of RUNS. Peak RssAnon is
# sampled by the driver itself from /proc/self/status (file-backed mapped pages do not count).
set -eu
build=${1:?usage: bench/safetensors_convert.sh BUILD_DIR [GIB] [RUNS]}
gib=${2:-3}
runs=${3:-3}
bin=$build/bin/bench-safetensors
[ -x "$bin" ] || { echo "no $bin: configure with -DSTATEDICT_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release" >&2; exit 2; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/statedict-convert.XXXXXX")
trap 'rm -rf "$dir"' EXIT INT TERM

"$bin" --make "$dir/in.safetensors" "$gib" >/dev/null
sync
cat "$dir/in.safetensors" >/dev/null

now() { date +%s.%N; }
best() { # best-of-N seconds of "$@"; removes $dir/out* before each run
  b=""
  i=0
  while [ "$i" -lt "$runs" ]; do
    rm -f "$dir"/out*
    sync
    t0=$(now)
    "$@" >"$dir/last.log"
    t1=$(now)
    t=$(echo "$t1 - $t0" | bc)
    if [ -z "$b" ] || [ "$(echo "$t < $b" | bc)" = 1 ]; then b=$t; fi
    i=$((i + 1))
  done
  echo "$b"
}
cp_sync() { cp "$1" "$2" && sync "$2"; }

size=$(stat -c %s "$dir/in.safetensors")
t_cp=$(best cp "$dir/in.safetensors" "$dir/out.cp")
t_cps=$(best cp_sync "$dir/in.safetensors" "$dir/out.cp")
t_conv=$(best "$bin" --convert "$dir/in.safetensors" "$dir/out.st")
rss_conv=$(sed -n 's/.*peak RssAnon \([0-9]*\) kB.*/\1/p' "$dir/last.log")
t_bf16=$(best "$bin" --convert "$dir/in.safetensors" "$dir/out.bf16" BF16)
rss_bf16=$(sed -n 's/.*peak RssAnon \([0-9]*\) kB.*/\1/p' "$dir/last.log")

ratio() { echo "scale=2; $1 / $2" | bc; }
printf 'input: %s bytes (%s GiB), best of %s runs, %s\n' "$size" "$gib" "$runs" "$(uname -r)"
printf '%-28s %8.2f s\n' "cp" "$t_cp"
printf '%-28s %8.2f s\n' "cp + sync" "$t_cps"
printf '%-28s %8.2f s  %5sx cp  %5sx cp+sync  peak RssAnon %s kB\n' "convert (no cast)" "$t_conv" \
  "$(ratio "$t_conv" "$t_cp")" "$(ratio "$t_conv" "$t_cps")" "$rss_conv"
printf '%-28s %8.2f s  %5sx cp  %5sx cp+sync  peak RssAnon %s kB\n' "convert --dtype BF16" "$t_bf16" \
  "$(ratio "$t_bf16" "$t_cp")" "$(ratio "$t_bf16" "$t_cps")" "$rss_bf16"
