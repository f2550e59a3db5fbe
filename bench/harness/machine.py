"""Facts about the machine a result was measured on."""
import os
import platform
import subprocess
import time


def _first(path, key):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cmd(argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def mount_of(path):
    """(mount point, device, fs type) of the filesystem holding path."""
    path = os.path.realpath(path)
    best = ("/", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    return best


def block_info(dev):
    name = os.path.basename(dev)
    base = f"/sys/class/block/{name}"
    if not os.path.exists(base):
        return ""
    bits = []
    for attr, label in (("queue/rotational", "rotational"), ("device/vendor", "vendor"), ("device/model", "model")):
        p = os.path.join(base, attr)
        if not os.path.exists(p):
            p = os.path.join(base, "..", attr)
        try:
            with open(p) as f:
                bits.append(f"{label}={f.read().strip()}")
        except OSError:
            pass
    driver = os.path.realpath(os.path.join(base, "device", "driver")) if os.path.exists(
        os.path.join(base, "device", "driver")) else ""
    if driver:
        bits.append(f"driver={os.path.basename(driver)}")
    return ", ".join(bits)


def loadavg():
    """The 1, 5 and 15-minute load averages (runnable + uninterruptible tasks; 2 = both CPUs busy)."""
    return [round(x, 2) for x in os.getloadavg()]


def facts(data_dir, statedict=None):
    mem_kib = int((_first("/proc/meminfo", "MemTotal") or "0 kB").split()[0])
    mnt, dev, fstype = mount_of(data_dir)
    flags = _first("/proc/cpuinfo", "flags") or ""
    vendor = ""
    for line in _cmd(["lscpu"]).splitlines():
        if line.startswith("Hypervisor vendor:"):
            vendor = line.split(":", 1)[1].strip()
    virt = f"{vendor or 'a'} hypervisor (virtual machine)" if " hypervisor" in f" {flags} " else "none detected"
    container = _cmd(["systemd-detect-virt", "--container"])
    if container and container != "none":
        virt += f"; container: {container}"
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": _first("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "ram_gib": round(mem_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "virtualization": virt,
        "data_dir": os.path.realpath(data_dir),
        "filesystem": f"{fstype} on {dev} (mounted at {mnt})",
        "block_device": block_info(dev),
        "python_peers": _cmd(["/usr/bin/python3", "-c",
                              "import sys, torch, numpy; print('Python %s, torch %s, numpy %s' % "
                              "(sys.version.split()[0], torch.__version__, numpy.__version__))"]),
        "compiler": _cmd(["c++", "--version"]).splitlines()[0] if _cmd(["c++", "--version"]) else "",
        "cp": _cmd(["cp", "--version"]).splitlines()[0] if _cmd(["cp", "--version"]) else "",
        "git": _cmd(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"]),
    }
    if statedict and os.path.exists(statedict):
        out["statedict"] = _cmd([statedict, "--version"])
    return out
