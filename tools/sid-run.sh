#!/bin/sh
# Runs a command inside the Debian sid root built by tools/sid-root.sh (today's PyTorch), with the
# host's directories that the command needs visible at the same absolute paths:
#
#   tools/sid-run.sh [--bind DIR]... [--] COMMAND [ARG]...
#   tools/sid-run.sh python3 tests/python/torch2/t2_check.py torch out.pt out.manifest.json
#
# Visible inside: this repository, the current directory, /tmp, every --bind DIR, every directory
# in $STATEDICT_SID_BINDS (colon-separated), and for each absolute-path argument (or the part
# after "=" of an --opt=/path argument) its nearest existing directory. /proc is mounted, and
# /dev (with /dev/shm, for gloo) and /sys are bound. All mounts live in a private mount namespace
# (unshare --mount), so they vanish with the command; nothing stays mounted on the host.
#
# The environment is passed through (PYTHONPATH included) except PATH, which is the root's, and
# PYTHONHOME/PYTHONUSERBASE, which point at the host's Python. Hugging Face libraries run offline
# (HF_HUB_OFFLINE=1), with HF_HOME under /tmp unless set. The exit status is the command's.
# Builds the root first when it is missing (minutes; see tools/sid-root.sh).
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${STATEDICT_SID_ROOT:-/var/cache/statedict/sid-root}
export STATEDICT_SID_ROOT="$ROOT"

if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    exec sudo -E "$0" "$@"
  fi
  echo "sid-run.sh: needs root (unshare --mount, chroot)" >&2
  exit 2
fi

binds=""
add_bind() { binds="$binds
$1"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --bind) [ $# -ge 2 ] || { echo "sid-run.sh: --bind needs a directory" >&2; exit 2; }
            add_bind "$2"; shift 2 ;;
    --bind=*) add_bind "${1#--bind=}"; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "usage: $0 [--bind DIR]... [--] COMMAND [ARG]..." >&2
  exit 2
fi

if [ ! -f "$ROOT/statedict-sid-root.stamp" ]; then
  echo "sid-run.sh: no sid root at $ROOT yet; building it (tools/sid-root.sh)" >&2
  "$here/tools/sid-root.sh" >&2
fi

add_bind "$here"
add_bind "$(pwd)"
add_bind /tmp
old_ifs=$IFS
IFS=:
for d in ${STATEDICT_SID_BINDS:-}; do add_bind "$d"; done
IFS=$old_ifs
for a in "$@"; do
  case "$a" in
    /*) p=$a ;;
    -*=/*) p=${a#*=} ;;
    *) continue ;;
  esac
  while [ ! -d "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done
  add_bind "$p"
done

# The mounts, in a private mount namespace. A directory is bound once: paths already covered by
# a bound parent are skipped, and so are system directories that the root has its own copy of,
# and paths whose place inside the root would resolve outside it (through an absolute symlink).
export SID_RUN_BINDS="$binds" SID_RUN_CWD="$(pwd)"
exec unshare --mount --propagation private /bin/sh -eu -c '
root=$(realpath -e "$1")
shift
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
done_list="
"
sorted=$(printf "%s\n" "$SID_RUN_BINDS" | sed "/^$/d" | while IFS= read -r x; do
           realpath -e "$x" 2>/dev/null || true; done | awk "{ print length(\$0) \"\t\" \$0 }" |
         sort -n | cut -f2- | uniq)
while IFS= read -r d; do
  [ -n "$d" ] || continue
  case "$d" in
    /|/usr|/usr/*|/etc|/etc/*|/bin|/bin/*|/sbin|/sbin/*|/lib|/lib/*|/lib64|/lib64/*|/proc|/proc/*|/dev|/dev/*|/sys|/sys/*|/var|/run|/root)
      continue ;;
  esac
  case "$d/" in "$root"/*) continue ;; esac
  covered=0
  while IFS= read -r c; do
    [ -n "$c" ] || continue
    case "$d/" in "$c"/*) covered=1; break ;; esac
  done <<EOF_DONE
$done_list
EOF_DONE
  [ "$covered" = 0 ] || continue
  case "$(realpath -m "$root$d")/" in
    "$root"/*) ;;
    *) echo "sid-run.sh: not binding $d (resolves outside the root)" >&2; continue ;;
  esac
  mkdir -p "$root$d"
  mount --rbind "$d" "$root$d"
  done_list="$done_list$d
"
done <<EOF_BINDS
$sorted
EOF_BINDS
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
unset PYTHONHOME PYTHONUSERBASE SID_RUN_BINDS
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HOME="${HF_HOME:-/tmp/statedict-sid-hf-home}"
cwd=$SID_RUN_CWD
unset SID_RUN_CWD
exec chroot "$root" /usr/bin/env -C "$cwd" "$@"
' sid-run "$ROOT" "$@"
