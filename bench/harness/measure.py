"""Run one command and measure it: wall time, peak RSS, peak anonymous RSS.

Method (details and limits in bench/README.md, "How things are measured"):
  * wall time: time.perf_counter() from just before fork/exec to the return of wait4().
  * peak RSS (total): the kernel's own high-water mark, VmHWM in /proc/<pid>/status, read with every
    sample below (it only grows, so the last read is the peak, up to the last sampling interval), the
    largest over the processes of the tree.  Includes file-backed mapped pages.  Not ru_maxrss: a
    vfork'ed child's exec() stores the *parent's* (the harness's) high-water mark into the child's
    signal->maxrss (fs/exec.c exec_mmap -> setmax_mm_hiwater_rss), so ru_maxrss of a 2 MiB cp read
    266 MiB here after the harness had mmap'ed outputs to check them; it is kept as ru_maxrss_kib.
    A command that exits before the first sample (< ~1 ms) has no memory figures (None).
  * cpu: user + system time from wait4(); background_cores: CPU time the rest of the machine used
    during the run (/proc/stat busy time minus the command's own, over the wall time; the harness's
    sampler thread is part of it).  Other work on a shared 2-core machine inflates wall times; this
    says when it happened.
  * peak anonymous RSS: not tracked by the kernel, so it is sampled.  A thread reads RssAnon from
    /proc/<pid>/status of the command and all its descendants every `interval` seconds (default
    2 ms; the counter read is ~15 us) and /proc/<pid>/smaps_rollup ("Anonymous:", an exact page-table
    walk: milliseconds for a process with GiBs mapped, under its mmap lock) every `rollup_interval`
    seconds (default 0.25); descendants are found by scanning /proc every `scan_interval` seconds (0.1) (this kernel has no /proc/<pid>/task/<tid>/children).  The peak is the
    maximum over samples of the per-sample sum over the process tree.  Samples taken before the child
    has exec'ed are discarded (a vfork'ed child still shows the harness's memory).  A spike shorter
    than the interval can be missed; bench/run.py --selftest measures what is caught.
"""
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field

_ANON = re.compile(rb"RssAnon:\s+(\d+) kB")
_RSS = re.compile(rb"VmRSS:\s+(\d+) kB")
_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")
_ROLLUP_ANON = re.compile(rb"\nAnonymous:\s+(\d+) kB")


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _descendants(root):
    """root and every process whose parent chain leads to root (one /proc scan)."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = _read(f"/proc/{d}/stat")
        if not st:
            continue
        try:
            ppid = int(st[st.rindex(b")") + 2:].split(b" ", 2)[1])
        except (ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [root], [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


class Sampler(threading.Thread):
    def __init__(self, pid, interval=0.002, scan_interval=0.1, rollup_interval=0.25):
        super().__init__(daemon=True)
        self.pid = pid
        self.interval = interval
        self.scan_interval = scan_interval
        self.rollup_interval = rollup_interval
        self.stop = threading.Event()
        self.peak_anon_status = 0  # kB
        self.peak_anon_rollup = 0  # kB
        self.peak_rss_sum = 0  # kB, sum over the tree
        self.hwm = {}  # pid -> last VmHWM seen (kB); VmHWM only grows
        self.samples = 0
        self.rollups = 0
        self.max_procs = 1
        self._own_cmdline = _read("/proc/self/cmdline")

    def _execed(self):
        cl = _read(f"/proc/{self.pid}/cmdline")
        return cl is not None and cl != self._own_cmdline and cl != b""

    def run(self):
        while not self.stop.is_set() and not self._execed():
            if _read(f"/proc/{self.pid}/stat") is None:
                return
            time.sleep(0.0002)
        pids = [self.pid]
        next_scan = next_rollup = 0.0
        while not self.stop.is_set():
            now = time.perf_counter()
            if now >= next_scan:
                pids = _descendants(self.pid)
                self.max_procs = max(self.max_procs, len(pids))
                next_scan = now + self.scan_interval
            anon = rss = 0
            root_alive = False
            for p in pids:
                st = _read(f"/proc/{p}/status")
                if not st:
                    continue
                m = _ANON.search(st)
                if m:  # zombies have no RssAnon line
                    root_alive = root_alive or p == self.pid
                    anon += int(m.group(1))
                    r = _RSS.search(st)
                    rss += int(r.group(1)) if r else 0
                    h = _HWM.search(st)
                    if h:
                        self.hwm[p] = max(self.hwm.get(p, 0), int(h.group(1)))
            if not root_alive:
                break
            self.samples += 1
            self.peak_anon_status = max(self.peak_anon_status, anon)
            self.peak_rss_sum = max(self.peak_rss_sum, rss)
            if now >= next_rollup:
                total = 0
                for p in pids:
                    ru = _read(f"/proc/{p}/smaps_rollup")
                    m = _ROLLUP_ANON.search(ru) if ru else None
                    total += int(m.group(1)) if m else 0
                self.rollups += 1
                self.peak_anon_rollup = max(self.peak_anon_rollup, total)
                next_rollup = now + self.rollup_interval
            self.stop.wait(self.interval)


@dataclass
class Run:
    argv: list
    rc: int
    wall: float  # seconds
    maxrss_kib: int  # peak RSS: the largest VmHWM of any process of the tree (kernel high-water mark, KiB)
    peak_anon_kib: int  # max of the two sampled sources
    peak_anon_status_kib: int
    peak_anon_rollup_kib: int
    peak_rss_sum_kib: int
    samples: int
    ru_maxrss_kib: int = 0  # wait4's ru_maxrss: polluted by the harness's own high-water mark, see above
    cpu: float = 0.0  # user + system CPU seconds of the command and its waited-for children
    background_cores: float = 0.0  # average CPUs kept busy by everything else during the run
    stderr_tail: str = ""
    extra: dict = field(default_factory=dict)


def _busy_seconds():
    """CPU-seconds spent busy by the whole machine since boot (all CPUs; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice (guest is included in user)
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")


def run(argv, stdout_path=None, stderr_path=None, env=None, cwd=None, interval=0.002,
        scan_interval=0.1, rollup_interval=0.25, timeout=None):
    out = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
    err = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL
    try:
        busy0 = _busy_seconds()
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        sampler = Sampler(proc.pid, interval, scan_interval, rollup_interval)
        sampler.start()
        timer = None
        if timeout:
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): never leave the command running
            proc.kill()
            os.wait4(proc.pid, 0)
            raise
        t1 = time.perf_counter()
        busy1 = _busy_seconds()
        if timer:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stop.set()
        sampler.join()
    finally:
        for f in (out, err):
            if f is not subprocess.DEVNULL:
                f.close()
    tail = ""
    if stderr_path:
        with open(stderr_path, "rb") as f:
            f.seek(max(0, os.path.getsize(stderr_path) - 2000))
            tail = f.read().decode("utf-8", "replace").strip()
    hwm = max(sampler.hwm.values(), default=0)
    sampled = sampler.samples > 0
    return Run(argv=list(argv), rc=proc.returncode, wall=t1 - t0, maxrss_kib=hwm if sampled else None,
               ru_maxrss_kib=ru.ru_maxrss,
               peak_anon_kib=max(sampler.peak_anon_status, sampler.peak_anon_rollup) if sampled else None,
               peak_anon_status_kib=sampler.peak_anon_status, peak_anon_rollup_kib=sampler.peak_anon_rollup,
               peak_rss_sum_kib=sampler.peak_rss_sum, samples=sampler.samples,
               cpu=ru.ru_utime + ru.ru_stime,
               background_cores=max(0.0, (busy1 - busy0) - (ru.ru_utime + ru.ru_stime)) / max(t1 - t0, 1e-9),
               stderr_tail=tail)


UNAVAILABLE = re.compile(r"not implemented|unsupported|not supported|no command|unknown command|"
                         r"not available|not yet", re.I)


def classify(r, binary=None):
    """'ok', 'unavailable' (binary missing, or exit 2 saying the capability is not there) or 'error'."""
    if binary and not os.path.exists(binary):
        return "unavailable"
    if r is None:
        return "unavailable"
    if r.rc == 0:
        return "ok"
    if r.rc == 2 and UNAVAILABLE.search(r.stderr_tail or ""):
        return "unavailable"
    return "error"
