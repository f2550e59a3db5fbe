#!/bin/bash
# Runs the job scripts of docs/slurm.md (docs/slurm/*) under a real Slurm and under torchrun,
# Open MPI and MPICH, and checks every multi-process result against a single-process conversion,
# file by file, byte for byte. Also the failure paths: an array task cancelled, an array task that
# fails, an srun task that fails (the job must end without the index), the index step before every
# part exists (it must refuse and name a missing file), and the rerun of one part (it must rewrite
# its own files only).
#
#   tests/slurm/run.sh BUILD_DIR        (uses BUILD_DIR/bin/statedict; needs root, or sudo)
#
# Slurm (Debian's slurm-wlm 22.05) runs on this machine only: munged, slurmctld and one slurmd with
# 4 CPUs, configured in a fresh temporary directory (SLURM_CONF, ports chosen at random), stopped
# on exit. Nothing under /etc is changed. The directory is kept after a failure (or with
# STATEDICT_SLURM_KEEP=1) until the next run, which also stops daemons that a killed run left.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: tests/slurm/run.sh BUILD_DIR" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "$1" && pwd)
cli=$build/bin/statedict
if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E "$0" "$build"
fi
[ -x "$cli" ] || {
  echo "tests/slurm: FAIL: no $cli (build the statedict_cli target first)" >&2
  exit 1
}
t0=$(date +%s)
say() { echo "== slurm: $* ($(($(date +%s) - t0)) s)"; }
fail() {
  echo "tests/slurm: FAIL: $*" >&2
  exit 1
}

packages="slurmctld slurmd slurm-client munge openmpi-bin mpich python3-torch"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  say "installing:$missing"
  apt-get update >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing >/dev/null
fi

# Nothing from an enclosing job or launcher may leak into the jobs and scripts under test.
for v in $(env | sed -n 's/^\(\(SLURM\|SBATCH\|SRUN\|SALLOC\|OMPI\|PMI\|PMIX\)_[A-Za-z0-9_]*\)=.*/\1/p'); do unset "$v"; done
unset RANK WORLD_SIZE LOCAL_RANK IN OUT LAYOUT PARTS THREADS
export PATH=$build/bin:$PATH
docs=$here/docs/slurm

# ---------------------------------------------------------------------------------------------
# The page and its scripts agree, and the scripts agree on their defaults.
python3 "$here/tools/doc_includes.py" --check || fail "docs/slurm.md differs from docs/slurm/*"
for v in IN OUT LAYOUT; do
  n=$(grep -h "^$v=" "$docs"/* | sort -u | wc -l)
  [ "$n" -eq 1 ] || fail "docs/slurm/*: the scripts set different defaults for $v: $(grep -h "^$v=" "$docs"/* | sort -u | tr '\n' ' ')"
done

running() { # pid: alive and not a zombie
  [ -r "/proc/$1/stat" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]
}
stop_pid() { # pid: SIGTERM, then SIGKILL after 10 s; returns once it has exited
  local i
  kill "$1" 2>/dev/null || return 0
  for i in $(seq 50); do
    running "$1" || return 0
    sleep 0.2
  done
  kill -9 "$1" 2>/dev/null || true
  for i in $(seq 25); do
    running "$1" || return 0
    sleep 0.2
  done
}

# ---------------------------------------------------------------------------------------------
# Daemons left by an earlier run that was killed before its trap ran: stopped by their pid files
# (only when the run that started them is gone, and only if the process is still that daemon).
for old in "${TMPDIR:-/tmp}"/statedict-slurm.*; do
  [ -f "$old/owner.pid" ] || continue
  kill -0 "$(cat "$old/owner.pid")" 2>/dev/null && continue
  for pf in "$old"/pids/*; do
    [ -f "$pf" ] || continue
    pid=$(cat "$pf")
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "$old"; then stop_pid "$pid"; fi
  done
  # owner.pid last: a directory that still has one is examined again by the next run.
  find "$old" -mindepth 1 -maxdepth 1 ! -name owner.pid -exec rm -rf {} + && rm -rf "$old" ||
    echo "tests/slurm: could not remove $old" >&2
done

work=$(mktemp -d "${TMPDIR:-/tmp}/statedict-slurm.XXXXXX")
chmod 755 "$work" # munged wants every directory above its socket searchable by all
echo $$ >"$work/owner.pid"
mkdir -p "$work/pids" "$work/munge" "$work/etc" "$work/state" "$work/spool" "$work/log" "$work/run"
chmod 755 "$work/munge"

stop_daemon() { # name
  local pf=$work/pids/$1
  [ -f "$pf" ] || return 0
  stop_pid "$(cat "$pf")"
  wait "$(cat "$pf")" 2>/dev/null || true
  rm -f "$pf"
}
cleanup() {
  local rc=$?
  set +e
  if [ -f "$work/pids/slurmctld" ]; then
    squeue -h -o %A 2>/dev/null | sort -u | xargs -r scancel 2>/dev/null
    for i in $(seq 25); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  stop_daemon slurmd
  stop_daemon slurmctld
  stop_daemon munged
  if [ $rc -ne 0 ]; then
    for f in "$work"/log/slurmctld.log "$work"/log/slurmd.log "$work"/log/*.out; do
      [ -s "$f" ] && { echo "--- last lines of $f"; tail -n 15 "$f"; }
    done
  fi
  if [ $rc -ne 0 ] || [ "${STATEDICT_SLURM_KEEP:-0}" = 1 ]; then
    echo "tests/slurm: kept $work"
  else
    rm -rf "$work"
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------------------------
say "starting munged, slurmctld and slurmd in $work"
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$work/munge/munge.key"
munged --foreground --key-file="$work/munge/munge.key" --socket="$work/munge/socket" \
  --pid-file="$work/munge/munged.pid" --log-file="$work/log/munged.log" --seed-file="$work/munge/seed" \
  >"$work/log/munged.stdout" 2>&1 &
echo $! >"$work/pids/munged"
for i in $(seq 50); do [ -S "$work/munge/socket" ] && break; sleep 0.1; done
[ -S "$work/munge/socket" ] || fail "munged did not start: $(tail -n 3 "$work/log/munged.stdout")"

read -r ctld_port slurmd_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
node=$(hostname -s)
: >"$work/etc/plugstack.conf"
cat >"$work/etc/slurm.conf" <<EOF
ClusterName=statedict
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge/socket
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/state/slurmctld.pid
SlurmdPidFile=$work/spool/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
PlugStackConfig=$work/etc/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
InactiveLimit=0
NodeName=$node NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$work/etc/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" >"$work/log/slurmctld.stdout" 2>&1 &
echo $! >"$work/pids/slurmctld"
slurmd -D -N "$node" -f "$SLURM_CONF" >"$work/log/slurmd.stdout" 2>&1 &
echo $! >"$work/pids/slurmd"
state=""
for i in $(seq 150); do
  state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.2
done
[ "$state" = idle ] || fail "the node did not become idle within 30 s (state '${state:-no answer}'): see $work/log"
say "Slurm is up: node $node, $(sinfo -h -n "$node" -o %c) CPUs, controller on port $ctld_port"

# ---------------------------------------------------------------------------------------------
# Helpers.

# Prints "task state exitcode reason" for a job: one line per array task, task "-" for a plain job.
job_states() {
  scontrol -o show job "$1" | tr ' ' '\n' | awk -F= '
    $1 == "JobId" { if (n++) print t, s, e, r; t = "-" } $1 == "ArrayTaskId" { t = $2 }
    $1 == "JobState" { s = $2 } $1 == "ExitCode" { e = $2 } $1 == "Reason" { r = $2 }
    END { if (n) print t, s, e, r }' | sort -n
}
# Waits until a job (all its array tasks) has ended; prints its job_states.
wait_job() {
  local id=$1 limit=${2:-60} i states
  for i in $(seq $((limit * 5))); do
    states=$(job_states "$id")
    if ! grep -qE ' (PENDING|RUNNING|CONFIGURING|COMPLETING|SUSPENDED|REQUEUED|RESIZING)' <<<"$states"; then
      echo "$states"
      return 0
    fi
    sleep 0.2
  done
  fail "job $id still not finished after $limit s: $(tr '\n' ';' <<<"$states")"
}
expect_states() { # id, expected job_states output (task state exitcode; reasons ignored)
  local got f
  got=$(wait_job "$1" | awk '{print $1, $2, $3}')
  if [ "$got" != "$2" ]; then
    for f in $(scontrol -o show job "$1" | tr ' ' '\n' | sed -n 's/^StdOut=//p' | sort -u); do
      [ -s "$f" ] && { echo "--- $f"; tail -n 5 "$f"; }
    done >&2
    fail "job $1: expected [$(tr '\n' ';' <<<"$2")], got [$(tr '\n' ';' <<<"$got")]"
  fi
}
# The two directories hold the same files (temporaries included), with the same bytes.
same_dir() {
  local ref=$1 out=$2 f
  [ -d "$out" ] || fail "$out was not written"
  local a b
  a=$(cd "$ref" && find . -mindepth 1 | sort)
  b=$(cd "$out" && find . -mindepth 1 | sort)
  [ "$a" = "$b" ] || fail "$out: other files than the single-process output: $(diff <(echo "$a") <(echo "$b") | grep '^[<>]' | tr '\n' ' ')"
  while read -r f; do
    cmp -s "$ref/$f" "$out/$f" || fail "$out/$f differs from the single-process output ($(cmp "$ref/$f" "$out/$f" 2>&1))"
  done <<<"$a"
}
# "name inode mtime" of every file of a directory.
snapshot() { (cd "$1" && find . -mindepth 1 -printf '%P %i %T@\n' | sort); }
# The index job of an array with part k missing was cancelled, and OUT has no index and no file of part k.
expect_index_cancelled() { # job id, out, kind, k
  local got f
  got=$(wait_job "$1")
  grep -q "^- CANCELLED .* DependencyNeverSatisfied$" <<<"$got" ||
    fail "index job $1 with part $4 missing: '$got', expected CANCELLED (DependencyNeverSatisfied)"
  [ ! -e "$2/${index_file[$3]}" ] || fail "an index was written although part $4 is missing"
  for f in $(cat "$work/files-$3-$4"); do [ ! -f "$2/$f" ] || fail "$2/$f exists although part $4 did not run"; done
}
# Reruns part k alone, then the index job; OUT then equals the reference, and the rerun changed
# only part k's files and added the index (the others keep their inode and mtime).
rerun_part() { # out, kind, k
  local before after changed rerun index
  before=$(snapshot "$1")
  rerun=$(sbatch --parsable --array="$3" "${sbatch_opts[@]}" --output="$work/log/rerun-%a.out" "$docs/reshard-array.sbatch")
  index=$(sbatch --parsable --dependency=afterok:"$rerun" --output="$work/log/rerun-index.out" "$docs/reshard-index.sbatch")
  expect_states "$rerun" "$3 COMPLETED 0:0"
  expect_states "$index" "- COMPLETED 0:0"
  same_dir "$work/ref-$2" "$1"
  after=$(snapshot "$1")
  changed=$(comm -13 <(echo "$before") <(echo "$after") | awk '{print $1}' | sort)
  [ "$changed" = "$(sort "$work/files-$2-$3" <(echo "${index_file[$2]}"))" ] ||
    fail "rerunning part $3 changed [$(echo $changed)], expected its files and the index only"
  say "part $3 rerun alone, then the index: equal to the single-process output; the other parts' files untouched"
}

in=$here/examples/checkpoints/zero3-tiny # DeepSpeed ZeRO-3, 4 ranks
K=4
declare -A layout=(
  [dcp]="--to dcp --world-size 8 --with-optimizer"    # 8 rank files: 2 per part
  [hf]="--max-shard-size 20KB --with-optimizer"       # 5 shards: one part writes 2
)
declare -A index_file=([dcp]=.metadata [hf]=model.safetensors.index.json)

say "single-process references, and which files each of the $K parts writes"
for kind in dcp hf; do
  statedict convert "$in" "$work/ref-$kind" ${layout[$kind]} 2>/dev/null || fail "single-process conversion ($kind) failed"
  for k in $(seq 0 $((K - 1))); do
    statedict convert "$in" "$work/owner-$kind-$k" ${layout[$kind]} --part "$k/$K" 2>/dev/null ||
      fail "part $k/$K ($kind) failed outside Slurm"
    (cd "$work/owner-$kind-$k" && find . -type f -printf '%P\n' | sort) >"$work/files-$kind-$k"
    [ -s "$work/files-$kind-$k" ] || fail "part $k/$K ($kind) writes no file: choose a layout with more files"
  done
  all=$(cat "$work"/files-$kind-* | sort)
  expected=$(cd "$work/ref-$kind" && find . -type f ! -name "${index_file[$kind]}" -printf '%P\n' | sort)
  [ "$all" = "$expected" ] || fail "the parts ($kind) do not write each file exactly once: $(echo $all) vs $(echo $expected)"
done
sbatch_opts=(--cpus-per-task=1)                                  # the scripts ask 16 per task
srun_job_opts=(--nodes=1 --ntasks=$K --ntasks-per-node=$K "${sbatch_opts[@]}") # and 8 nodes

# ---------------------------------------------------------------------------------------------
for kind in dcp hf; do
  say "reshard.sbatch ($kind): srun, $K tasks"
  out=$work/run/srun-$kind
  id=$(IN=$in OUT=$out LAYOUT=${layout[$kind]} sbatch --parsable "${srun_job_opts[@]}" \
    --output="$work/log/srun-$kind.out" "$docs/reshard.sbatch")
  expect_states "$id" "- COMPLETED 0:0"
  same_dir "$work/ref-$kind" "$out"

  say "submit-array.sh ($kind): array of $K tasks, then the index job"
  out=$work/run/array-$kind
  ids=$(IN=$in OUT=$out LAYOUT=${layout[$kind]} PARTS=$K "$docs/submit-array.sh" --array=0-$((K - 1)) \
    "${sbatch_opts[@]}" --output="$work/log/array-$kind-%a.out")
  parts=$(sed -n 1p <<<"$ids") index=$(sed -n 2p <<<"$ids")
  expect_states "$parts" "$(for k in $(seq 0 $((K - 1))); do echo "$k COMPLETED 0:0"; done)"
  expect_states "$index" "- COMPLETED 0:0"
  same_dir "$work/ref-$kind" "$out"
done

# ---------------------------------------------------------------------------------------------
say "array task 2 cancelled: the index job is cancelled, the index step refuses, task 2 alone is rerun"
kind=dcp
out=$work/run/cancel-$kind
export IN=$in OUT=$out LAYOUT=${layout[$kind]} PARTS=$K
ids=$("$docs/submit-array.sh" --hold --array=0-$((K - 1)) "${sbatch_opts[@]}" --output="$work/log/cancel-%a.out")
parts=$(sed -n 1p <<<"$ids") index=$(sed -n 2p <<<"$ids")
scancel "${parts}_2" # held, so certainly before it ran: Slurm drops the task from the array
scontrol release "$parts"
expect_states "$parts" "0 COMPLETED 0:0
1 COMPLETED 0:0
3 COMPLETED 0:0"
expect_index_cancelled "$index" "$out" "$kind" 2

id=$(sbatch --parsable --output="$work/log/index-early.out" "$docs/reshard-index.sbatch")
expect_states "$id" "- FAILED 2:0"
msg=$(cat "$work/log/index-early.out")
grep -qF "statedict: [statedict.usage_error.743] DCP checkpoint '$out': " <<<"$msg" && grep -qF "missing (" <<<"$msg" &&
  grep -qF "): write every part before the index" <<<"$msg" ||
  fail "the index step before part 2 was written said: '$msg' (expected it to list part 2's files as missing)"
while read -r f; do
  grep -qF "'$f'" <<<"$msg" || fail "the index step's message does not name part 2's missing file '$f': '$msg'"
done <"$work/files-$kind-2"
[ ! -e "$out/${index_file[$kind]}" ] || fail "the refused index step wrote an index"
say "the index step refused: $msg"
rerun_part "$out" "$kind" 2

say "part 1 rerun after the index: it rewrites its own files only"
before=$(snapshot "$out")
rerun=$(sbatch --parsable --array=1 "${sbatch_opts[@]}" --output="$work/log/rerun-%a.out" "$docs/reshard-array.sbatch")
expect_states "$rerun" "1 COMPLETED 0:0"
after=$(snapshot "$out")
changed=$(comm -13 <(echo "$before") <(echo "$after") | awk '{print $1}' | sort)
[ "$changed" = "$(sort "$work/files-$kind-1")" ] || fail "rerunning part 1 changed [$(echo $changed)], expected [$(echo $(cat "$work/files-$kind-1"))]"
same_dir "$work/ref-$kind" "$out"

say "array task 1 fails: the index job is cancelled, task 1 alone is rerun"
kind=hf
out=$work/run/fail-$kind
export OUT=$out LAYOUT=${layout[$kind]}
victim=$(head -n 1 "$work/files-$kind-1")
mkdir -p "$out/$victim" # a directory where part 1 must put a file: its rename fails
ids=$("$docs/submit-array.sh" --array=0-$((K - 1)) "${sbatch_opts[@]}" --output="$work/log/fail-%a.out")
parts=$(sed -n 1p <<<"$ids") index=$(sed -n 2p <<<"$ids")
expect_states "$parts" "0 COMPLETED 0:0
1 FAILED 2:0
2 COMPLETED 0:0
3 COMPLETED 0:0"
msg=$(cat "$work/log/fail-1.out")
grep -qF "'$out/$victim'" <<<"$msg" || fail "the failed part did not name its file: $msg"
say "part 1 failed: $msg"
expect_index_cancelled "$index" "$out" "$kind" 1
rmdir "$out/$victim"
rerun_part "$out" "$kind" 1
unset IN OUT LAYOUT PARTS

# ---------------------------------------------------------------------------------------------
say "reshard.sbatch with a failing task: srun fails, the job ends without the index"
kind=hf
out=$work/run/srun-fail-$kind
victim=$(head -n 1 "$work/files-$kind-1")
mkdir -p "$out/$victim" # a directory where part 1 must put a file: its rename fails
id=$(IN=$in OUT=$out LAYOUT=${layout[$kind]} sbatch --parsable "${srun_job_opts[@]}" \
  --output="$work/log/srun-fail.out" "$docs/reshard.sbatch")
got=$(wait_job "$id")
grep -q "^- FAILED [1-9]" <<<"$got" || fail "job $id with a failing task: '$got', expected FAILED with a non-zero exit code"
log=$(cat "$work/log/srun-fail.out")
grep -qF "'$out/$victim'" <<<"$log" || fail "the failing task did not say why: $log"
! grep -q "before the index" <<<"$log" || fail "the script ran the index step after srun failed: $log"
[ ! -e "$out/${index_file[$kind]}" ] || fail "an index was written although a task failed"
say "srun failed as expected: $(grep -F "'$out/$victim'" <<<"$log" | head -n 1)"
rmdir "$out/$victim"
id=$(IN=$in OUT=$out LAYOUT=${layout[$kind]} sbatch --parsable "${srun_job_opts[@]}" \
  --output="$work/log/srun-fail-again.out" "$docs/reshard.sbatch")
expect_states "$id" "- COMPLETED 0:0"
same_dir "$work/ref-$kind" "$out"

# ---------------------------------------------------------------------------------------------
# reshard-part.sh under each launcher, then `reshard-part.sh index`.
launch() { # name, kind, command...
  local name=$1 kind=$2
  shift 2
  local out=$work/run/$name-$kind
  say "reshard-part.sh under $name ($kind), $K processes"
  IN=$in OUT=$out LAYOUT=${layout[$kind]} timeout 120 "$@" "$docs/reshard-part.sh" >"$work/log/$name-$kind.out" 2>&1 ||
    fail "$name ($kind) failed: $(tail -n 5 "$work/log/$name-$kind.out")"
  IN=$in OUT=$out LAYOUT=${layout[$kind]} "$docs/reshard-part.sh" index 2>>"$work/log/$name-$kind.out" ||
    fail "reshard-part.sh index after $name ($kind) failed: $(tail -n 3 "$work/log/$name-$kind.out")"
  same_dir "$work/ref-$kind" "$out"
}
for kind in dcp hf; do
  launch srun "$kind" srun --ntasks=$K --cpus-per-task=1
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 launch mpirun "$kind" mpirun.openmpi -n $K --oversubscribe
  launch mpiexec "$kind" mpiexec.mpich -n $K
done
# Debian's torch 1.13 on Python 3.11 crashes on torchrun's default --redirects/--tee ("0": its
# Std enum lookup skips the zero member); a mapping for a rank that does not exist means "none".
launch torchrun dcp torchrun --standalone --nproc_per_node=$K --redirects $K:1 --tee $K:1 --no_python

say "reshard-part.sh without a launcher refuses"
if msg=$(IN=$in OUT=$work/run/nolauncher "$docs/reshard-part.sh" 2>&1); then fail "reshard-part.sh ran without a launcher"; fi
grep -q "no launcher rank in the environment" <<<"$msg" || fail "reshard-part.sh without a launcher said: $msg"
[ ! -e "$work/run/nolauncher" ] || fail "reshard-part.sh without a launcher wrote $work/run/nolauncher"

say "all passed"
