"""Stamp files: generated data is reused when the parameters that made it are unchanged.

A stamp is `<target>.stamp.json` next to the data: the generator's parameters plus the size of
every file it wrote.  `fresh(stamp, params)` is true only if the parameters match exactly and every
recorded file still exists with its recorded size.
"""
import json
import os


def _files_under(path):
    if os.path.isfile(path):
        yield path
        return
    for root, _, files in os.walk(path):
        for f in files:
            yield os.path.join(root, f)


def record(stamp_path, params, outputs):
    """outputs: files or directories written by the generator."""
    sizes = {}
    base = os.path.dirname(os.path.abspath(stamp_path))
    for out in outputs:
        for f in _files_under(out):
            sizes[os.path.relpath(os.path.abspath(f), base)] = os.path.getsize(f)
    with open(stamp_path + ".tmp", "w") as fh:
        json.dump({"params": params, "files": sizes}, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(stamp_path + ".tmp", stamp_path)


def fresh(stamp_path, params):
    try:
        with open(stamp_path) as fh:
            st = json.load(fh)
    except (OSError, ValueError):
        return False
    if st.get("params") != json.loads(json.dumps(params)):
        return False
    base = os.path.dirname(os.path.abspath(stamp_path))
    for rel, size in st.get("files", {}).items():
        p = os.path.join(base, rel)
        if not os.path.isfile(p) or os.path.getsize(p) != size:
            return False
    return bool(st.get("files"))


def sync_paths(paths):
    """fsync every file under paths (so later page-cache eviction with fadvise really drops them)."""
    for p in paths:
        for f in _files_under(p):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
