#!/bin/sh
# Builds (once per machine) a Debian sid root with today's PyTorch, safetensors, transformers,
# huggingface_hub and numpy, used as the second oracle of the test suite (tests/python/torch2/).
#
#   tools/sid-root.sh            # build if missing, then print the versions
#   tools/sid-root.sh --rebuild  # throw the root away and build it again
#   tools/sid-root.sh --print-root
#
# The root lives outside any clone, at $STATEDICT_SID_ROOT (default /var/cache/statedict/sid-root),
# so every clone and CI run on the machine shares it. It is built in a temporary directory next
# to it and renamed only when complete; the stamp file $ROOT/statedict-sid-root.stamp records
# the package list and the versions, so an interrupted build never looks complete and a change
# of the package list below builds it again. The first build downloads ~600 MB and takes ~5
# minutes and ~2.5 GB of disk. Needs root (debootstrap, chroot).
#
# Run commands inside it with tools/sid-run.sh.
set -eu

ROOT=${STATEDICT_SID_ROOT:-/var/cache/statedict/sid-root}
PACKAGES="python3-torch python3-safetensors python3-transformers python3-huggingface-hub python3-numpy"
STAMP_NAME=statedict-sid-root.stamp
APT_OPTS="-o Acquire::Check-Valid-Until=false -o Acquire::Retries=3"

case "${1:-}" in
  --print-root) echo "$ROOT"; exit 0 ;;
  --rebuild) rebuild=1 ;;
  "") rebuild=0 ;;
  *) echo "usage: $0 [--rebuild|--print-root]" >&2; exit 2 ;;
esac

if [ "$(id -u)" -ne 0 ]; then
  echo "sid-root.sh: needs root (debootstrap and chroot)" >&2
  exit 2
fi

# Prints the versions of the oracle's Python packages, as the sid root's python3 sees them.
versions() {  # root
  unshare --mount --propagation private sh -eu -c '
    mount -t proc proc "$1/proc"
    chroot "$1" /usr/bin/python3 -c "
import sys, numpy, torch, safetensors, transformers, huggingface_hub
print(\"python\", sys.version.split()[0])
for m in (torch, safetensors, transformers, huggingface_hub, numpy):
    print(m.__name__, m.__version__)
"' sid-root "$1"
}

stamp_ok() {  # root
  [ -f "$1/$STAMP_NAME" ] && grep -qx "packages: $PACKAGES" "$1/$STAMP_NAME"
}

if [ "$rebuild" = 0 ] && stamp_ok "$ROOT"; then
  sed -n 's/^version: //p' "$ROOT/$STAMP_NAME"
  exit 0
fi

parent=$(dirname "$ROOT")
mkdir -p "$parent"
# A previous interrupted build may have left temporary roots; they hold no mounts (see below),
# so they can simply be removed.
for old in "$ROOT".tmp.*; do
  [ -d "$old" ] || continue
  if grep -q " $old/" /proc/self/mounts; then
    echo "sid-root.sh: $old still has mounts; unmount them first" >&2
    exit 1
  fi
  echo "== removing the incomplete build $old"
  rm -rf "$old"
done

if ! command -v debootstrap >/dev/null 2>&1; then
  echo "== installing debootstrap"
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap
fi

tmp="$ROOT.tmp.$$"
t0=$(date +%s)
echo "== debootstrap --variant=minbase sid $tmp"
debootstrap --variant=minbase sid "$tmp"

# apt runs inside a private mount namespace: the /proc it mounts vanishes with it, and nothing
# is left mounted under $tmp whatever happens.
echo "== installing $PACKAGES"
cp /etc/resolv.conf "$tmp/etc/resolv.conf" 2>/dev/null || true
unshare --mount --propagation private sh -eu -c '
  mount -t proc proc "$1/proc"
  chroot "$1" env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 apt-get $2 update
  chroot "$1" env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 apt-get $2 install -y --no-install-recommends $3
  chroot "$1" apt-get clean
' sid-root "$tmp" "$APT_OPTS" "$PACKAGES"

v=$(versions "$tmp") || {
  echo "sid-root.sh: the new root cannot import its packages" >&2
  exit 1
}
{
  echo "packages: $PACKAGES"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(( $(date +%s) - t0 )) s"
  echo "$v" | sed 's/^/version: /'
} >"$tmp/$STAMP_NAME"

if [ -e "$ROOT" ]; then
  if grep -q " $ROOT/" /proc/self/mounts; then
    echo "sid-root.sh: $ROOT still has mounts; unmount them first" >&2
    exit 1
  fi
  rm -rf "$ROOT"
fi
mv "$tmp" "$ROOT"
echo "== $ROOT ready in $(( $(date +%s) - t0 )) s"
echo "$v"
