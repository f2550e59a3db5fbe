#!/usr/bin/python3
"""Check a file written by statedict against a manifest, using real PyTorch
(torch.save files) or an independent strict reader (safetensors).

Usage:
  /usr/bin/python3 tests/python/torch_check.py FILE MANIFEST [--weights-only]
        [--expect-tied A B]... [--check-aliases]
  /usr/bin/python3 tests/python/torch_check.py --safetensors FILE MANIFEST
        [--lenient] [--canonical]

Exit status: 0 when everything matches, 1 with one line per problem on stdout
otherwise, 2 on bad usage.

torch mode: torch.load(FILE[, weights_only=True]), flatten to dotted names,
compare dtype / shape / sha256 of every tensor and every non-tensor value with
MANIFEST (names missing on either side are reported).  --expect-tied A B checks
that A and B share storage after loading.  --check-aliases checks every
"aliases" entry of the manifest the same way.  If the manifest has
"dict_attributes" (e.g. state_dict()._metadata) they are compared too.

safetensors mode: reads FILE with the strict reader below, reports the first
violated rule by name (e.g. "InvalidOffset: ..."), then compares tensors (and
"metadata" if the manifest has it) with MANIFEST.
  rules from the reference reader (huggingface/safetensors):
    HeaderTooSmall, HeaderTooLarge, InvalidHeaderLength, InvalidHeader (UTF-8),
    InvalidHeaderStart, InvalidHeaderDeserialization (JSON / schema / unknown
    dtype / __metadata__ not str->str), InvalidOffset, ValidationOverflow,
    MisalignedSlice, TensorInvalidInfo, MetadataIncompleteBuffer
  strict extras for our writer (disabled by --lenient):
    DuplicateKey, UnknownTensorField, HeaderNotAligned (N % 8 != 0),
    HeaderPaddingNotSpaces (anything but spaces around the JSON object)
  --canonical: also require the exact bytes the reference writer would produce
    (gen_safetensors.header_bytes + data in the reference order): NotCanonical
"""
import argparse
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


# =========================================================================== comparison
def compare_with_manifest(manifest, tensors, values, label="FILE"):
    """tensors: {name: {"dtype","shape","sha256"}}, values: {name: json}. -> [problems]"""
    problems = []
    exp_t = manifest.get("tensors", {})
    exp_v = manifest.get("values", {})
    # Objects written as their data: the attributes below these names are not compared (their
    # tensors are, listed in "tensors").
    free = manifest.get("unchecked_values_under", [])
    values = {n: v for n, v in values.items() if not any(n == k or n.startswith(k + ".") for k in free)}
    for name, e in exp_t.items():
        g = tensors.get(name)
        if g is None:
            if name in values:
                problems.append(f"{name}: expected a {e['dtype']} tensor, {label} has the value {values[name]!r}")
            else:
                problems.append(f"{name}: tensor missing from {label}")
            continue
        for field in ("dtype", "shape", "sha256"):
            if field in e and e[field] != g[field]:
                problems.append(f"{name}: {field} {g[field]} != expected {e[field]}")
    for name in tensors:
        if name not in exp_t and name not in exp_v:
            problems.append(f"{name}: unexpected tensor in {label} ({tensors[name]['dtype']} {tensors[name]['shape']})")
    for name, e in exp_v.items():
        if name in exp_t:
            continue
        if name not in values:
            if name in tensors:
                problems.append(f"{name}: expected value {e!r}, {label} has a tensor")
            else:
                problems.append(f"{name}: value missing from {label}")
        elif not C.values_equal(values[name], e):
            problems.append(f"{name}: value {json.dumps(values[name])} != expected {json.dumps(e)}")
    for name in values:
        if name not in exp_v and name not in exp_t:
            problems.append(f"{name}: unexpected value in {label}: {json.dumps(values[name])}")
    return problems


# =========================================================================== torch mode
def load_torch(path, weights_only):
    import torch
    if weights_only:
        return torch.load(path, map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu")


def leaf_map(obj):
    return {C.dotted(p): v for p, v in C.iter_leaves(obj)}


def shares_storage(a, b):
    return (C.is_tensor(a) and C.is_tensor(b) and a.device == b.device
            and a.storage().data_ptr() == b.storage().data_ptr() and a.storage().size() > 0)


def check_torch(path, manifest, weights_only=False, tied=(), check_aliases=False):
    try:
        obj = load_torch(path, weights_only)
    except Exception as e:
        msg = " ".join(str(e).split())
        return [f"torch.load{'(weights_only=True)' if weights_only else ''} failed: {type(e).__name__}: {msg}"]
    tensors, values, _ = C.flatten(obj)
    problems = compare_with_manifest(manifest, tensors, values)
    leaves = leaf_map(obj)
    pairs = [(a, b, "--expect-tied") for a, b in tied]
    if check_aliases:
        pairs += [(a, b, "manifest alias") for a, b in manifest.get("aliases", {}).items()]
    for a, b, why in pairs:
        if a not in leaves or b not in leaves:
            problems.append(f"{a}: {why} {a} {b}: {'/'.join(n for n in (a, b) if n not in leaves)} not in FILE")
        elif not shares_storage(leaves[a], leaves[b]):
            problems.append(f"{a}: {why}: {a} and {b} do not share storage after loading")
    if "dict_attributes" in manifest:
        got = C.dict_attributes(obj)
        if not C.values_equal(got, manifest["dict_attributes"]):
            problems.append(f"dict_attributes differ: got {json.dumps(got)[:300]}")
    return problems


# =========================================================================== safetensors
MAX_HEADER_SIZE = 100_000_000
USIZE_MAX = (1 << 64) - 1


class SafetensorsRuleError(Exception):
    def __init__(self, rule, detail):
        super().__init__(f"{rule}: {detail}")
        self.rule = rule


def _reject_constants(s):
    raise ValueError(f"not JSON: {s}")


def _pairs_hook(strict):
    def hook(pairs):
        d = {}
        for k, v in pairs:
            if k in d and strict:
                raise SafetensorsRuleError("DuplicateKey", f"key {k!r} appears twice in one JSON object")
            d[k] = v
        return d
    return hook


def _is_uint(x):
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= USIZE_MAX


def read_safetensors(path, strict=True):
    """Strictly parse a .safetensors file.

    Returns (entries, metadata, n, data_start, blob) where entries is a list of
    (name, dtype, shape, begin, end) in offset order.  Raises
    SafetensorsRuleError naming the first violated rule.
    """
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise SafetensorsRuleError("HeaderTooSmall", f"file has {len(blob)} bytes, fewer than 8")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER_SIZE:
        raise SafetensorsRuleError("HeaderTooLarge", f"header length {n} > {MAX_HEADER_SIZE}")
    if 8 + n > len(blob):
        raise SafetensorsRuleError("InvalidHeaderLength", f"header length {n} runs past the end of the {len(blob)}-byte file")
    raw = blob[8:8 + n]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsRuleError("InvalidHeader", f"header is not UTF-8 ({e})")
    if not text.startswith("{"):
        raise SafetensorsRuleError("InvalidHeaderStart", f"header starts with {text[:1]!r}, not '{{'")
    try:
        dec = json.JSONDecoder(object_pairs_hook=_pairs_hook(strict), parse_constant=_reject_constants)
        obj, end = dec.raw_decode(text)
        rest = text[end:]
        if rest.strip(" \t\n\r"):
            raise ValueError(f"trailing data after the JSON object: {rest[:20]!r}")
    except SafetensorsRuleError:
        raise
    except ValueError as e:
        raise SafetensorsRuleError("InvalidHeaderDeserialization", str(e))
    if not isinstance(obj, dict):
        raise SafetensorsRuleError("InvalidHeaderDeserialization", "header is not a JSON object")
    if strict:
        if n % 8:
            raise SafetensorsRuleError("HeaderNotAligned", f"header length {n} is not a multiple of 8")
        if rest.strip(" "):
            raise SafetensorsRuleError("HeaderPaddingNotSpaces", f"padding after the JSON object is {rest!r}")

    metadata = None
    entries = []
    for name, info in obj.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise SafetensorsRuleError("InvalidHeaderDeserialization", "__metadata__ is not a map of str to str")
            metadata = info
            continue
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise SafetensorsRuleError("InvalidHeaderDeserialization", f"{where}: info is not an object")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in info:
                raise SafetensorsRuleError("InvalidHeaderDeserialization", f"{where}: missing field {field!r}")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in C.DTYPE_BITS or dtype == "C128":
            raise SafetensorsRuleError("InvalidHeaderDeserialization", f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
            raise SafetensorsRuleError("InvalidHeaderDeserialization", f"{where}: shape {shape!r} is not a list of unsigned ints")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_uint(o) for o in offs):
            raise SafetensorsRuleError("InvalidHeaderDeserialization", f"{where}: data_offsets {offs!r} is not [begin, end]")
        if strict:
            extra = sorted(set(info) - {"dtype", "shape", "data_offsets"})
            if extra:
                raise SafetensorsRuleError("UnknownTensorField", f"{where}: unexpected fields {extra}")
        entries.append((name, dtype, list(shape), offs[0], offs[1]))

    entries.sort(key=lambda e: (e[3], e[4]))
    start = 0
    for name, dtype, shape, s, e in entries:
        if s != start or e < s:
            raise SafetensorsRuleError("InvalidOffset", f"tensor {name!r}: data_offsets [{s}, {e}], expected to start at {start}")
        start = e
        numel = 1
        for d in shape:
            numel *= d
            if numel > USIZE_MAX:
                raise SafetensorsRuleError("ValidationOverflow", f"tensor {name!r}: element count of {shape} overflows")
        bits = numel * C.DTYPE_BITS[dtype]
        if bits > USIZE_MAX:
            raise SafetensorsRuleError("ValidationOverflow", f"tensor {name!r}: bit size of {dtype}{shape} overflows")
        if bits % 8:
            raise SafetensorsRuleError("MisalignedSlice", f"tensor {name!r}: {dtype}{shape} is not a whole number of bytes")
        if e - s != bits // 8:
            raise SafetensorsRuleError("TensorInvalidInfo", f"tensor {name!r}: {dtype}{shape} needs {bits // 8} bytes, data_offsets give {e - s}")
    if 8 + n + start != len(blob):
        raise SafetensorsRuleError("MetadataIncompleteBuffer",
                                   f"tensor data ends at byte {8 + n + start}, file has {len(blob)} bytes")
    return entries, metadata, n, 8 + n, blob


def check_canonical(entries, metadata, n, blob):
    import gen_safetensors as G
    tensors = {name: (dtype, shape, None) for name, dtype, shape, _, _ in entries}
    want_hb, order = G.header_bytes(tensors, metadata)
    got_hb = blob[8:8 + n]
    file_order = [e[0] for e in entries]
    if file_order != order:
        return [f"NotCanonical: data order {file_order[:5]}... differs from the reference order {order[:5]}..."]
    if got_hb != want_hb:
        i = next((k for k in range(min(len(got_hb), len(want_hb))) if got_hb[k] != want_hb[k]),
                 min(len(got_hb), len(want_hb)))
        return [f"NotCanonical: header differs from the reference writer's at byte {i}: "
                f"got {got_hb[max(0, i - 20):i + 20]!r}, expected {want_hb[max(0, i - 20):i + 20]!r}"]
    return []


def check_safetensors(path, manifest, strict=True, canonical=False):
    try:
        entries, metadata, n, data_start, blob = read_safetensors(path, strict)
    except SafetensorsRuleError as e:
        return [str(e)]
    except OSError as e:
        return [f"cannot read {path}: {e}"]
    problems = check_canonical(entries, metadata, n, blob) if canonical else []
    tensors = {}
    for name, dtype, shape, s, e in entries:
        tensors[name] = {"dtype": dtype, "shape": shape,
                         "sha256": C.sha256_hex(blob[data_start + s:data_start + e])}
    problems += compare_with_manifest(manifest, tensors, {})
    if "metadata" in manifest and manifest["metadata"] != metadata:
        problems.append(f"__metadata__ {json.dumps(metadata, ensure_ascii=False)} != expected "
                        f"{json.dumps(manifest['metadata'], ensure_ascii=False)}")
    return problems


# =========================================================================== main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE")
    p.add_argument("manifest", metavar="MANIFEST")
    p.add_argument("--safetensors", action="store_true", help="FILE is a .safetensors file")
    p.add_argument("--weights-only", action="store_true", help="torch.load(..., weights_only=True)")
    p.add_argument("--expect-tied", nargs=2, action="append", default=[], metavar=("A", "B"))
    p.add_argument("--check-aliases", action="store_true")
    p.add_argument("--lenient", action="store_true", help="safetensors: reference rules only")
    p.add_argument("--canonical", action="store_true", help="safetensors: require reference-writer bytes")
    return p.parse_args(argv)


def main(argv):
    args = parse_args(argv[1:])
    try:
        manifest = C.load_manifest(args.manifest)
    except (OSError, ValueError) as e:
        print(f"cannot read manifest {args.manifest}: {e}")
        return 2
    if args.safetensors:
        problems = check_safetensors(args.file, manifest, strict=not args.lenient, canonical=args.canonical)
    else:
        problems = check_torch(args.file, manifest, args.weights_only, args.expect_tied, args.check_aliases)
    for line in problems:
        print(line)
    if problems:
        print(f"FAIL {args.file}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
