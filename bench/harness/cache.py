"""Page-cache control for the cold condition, and residency checks.

Cold method "fadvise" (default, unprivileged, targeted): after a global sync (so no page is dirty),
posix_fadvise(POSIX_FADV_DONTNEED) on every input file drops its clean pages from the page cache;
mincore(2) on a mapping of the file then confirms how much is still resident.  Only the inputs are
evicted: program binaries, shared libraries (libtorch ...) and Python modules stay cached, so "cold"
means "the checkpoint bytes come from the disk", not "the machine just booted".
Method "drop_caches" (root only; global: it also evicts other users' and the tools' own files):
`sync; echo 3 > /proc/sys/vm/drop_caches`.
"""
import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def files_under(paths):
    for p in paths:
        if os.path.isfile(p):
            yield p
        elif os.path.isdir(p):
            for root, _, files in os.walk(p):
                for f in sorted(files):
                    yield os.path.join(root, f)


def total_bytes(paths):
    return sum(os.path.getsize(f) for f in files_under(paths))


def evict(paths):
    """Drop the (clean) cached pages of every file under paths.  Call sync_all() first."""
    for f in files_under(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(paths):
    """(resident bytes, total bytes) of the files under paths, from mincore(2)."""
    res = tot = 0
    for f in files_under(paths):
        size = os.path.getsize(f)
        tot += size
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap {f}")
            try:
                n = (size + _PAGE - 1) // _PAGE
                vec = (ctypes.c_ubyte * n)()
                if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {f}")
                pages = sum(1 for b in bytes(vec) if b & 1)
                res += min(size, pages * _PAGE)
            finally:
                _libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return res, tot


def sync_all():
    os.sync()


def drop_caches_possible():
    """(bool, reason).  Detection only: nothing is dropped here."""
    path = "/proc/sys/vm/drop_caches"
    if not os.path.exists(path):
        return False, f"{path} does not exist"
    if os.geteuid() != 0:
        return False, f"not root (euid {os.geteuid()})"
    if not os.access(path, os.W_OK):
        return False, f"{path} is not writable (read-only /proc/sys?)"
    return True, "root and /proc/sys/vm/drop_caches writable"


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def make_cold(paths, method="fadvise"):
    """Evict the inputs; returns the fraction of their bytes still resident afterwards."""
    sync_all()
    if method == "drop_caches":
        drop_caches()
    else:
        evict(paths)
    res, tot = resident(paths)
    return res / tot if tot else 0.0
