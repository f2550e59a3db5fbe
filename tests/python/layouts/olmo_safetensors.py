"""Reference reader for OLMo's "mapped" safetensors files (olmo/safetensors_util.py).

A nested state dict is stored as one safetensors file whose tensor names are
    urlsafe_base64(pickle.dumps((key_path_tuple, value_is_pickled)))
Tensor leaves are stored as themselves; every other leaf that is not a dict is pickled and stored as a
1-D U8 tensor. Dicts are walked, never pickled; lists and tuples are leaves (pickled whole).

decode_file() reproduces safetensors_file_to_state_dict(): it parses the file (strictly, with the
rules of torch_check.read_safetensors), decodes every name, unpickles every pickled value, and rebuilds
the nested dict. Unlike OLMo's loader it never runs a pickle that names a global outside a small
allow-list (OLMo calls pickle.loads on file content), and it rejects duplicate or conflicting key
paths, empty paths, and key elements that are not str or int (OLMo's unflatten_dict silently
overwrites, or writes into a pickled list, in those cases). See layouts/olmo_safetensors.md.
"""
import base64
import binascii
import json
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_check  # noqa: E402  (strict safetensors parser)
from layouts._raw import RawTensor, restricted_loads  # noqa: E402

PICKLE_PROTOCOL = 4  # pickle.DEFAULT_PROTOCOL on Python 3.8 .. 3.13 (3.14: 5)


class OlmoFormatError(Exception):
    def __init__(self, rule, detail):
        super().__init__(f"{rule}: {detail}")
        self.rule = rule


class Entry:
    __slots__ = ("name", "keys", "pickled", "tensor", "value")

    def __init__(self, name, keys, pickled, tensor, value):
        self.name, self.keys, self.pickled, self.tensor, self.value = name, keys, pickled, tensor, value


def decode_name(name):
    """Tensor name -> (keys tuple, value_is_pickled). Raises OlmoFormatError."""
    try:
        raw = base64.urlsafe_b64decode(name.encode("ascii"))
    except (UnicodeEncodeError, binascii.Error, ValueError) as e:
        raise OlmoFormatError("BadKeyBase64", f"{name!r} is not urlsafe base64 ({e})")
    if base64.urlsafe_b64encode(raw).decode("ascii") != name:
        raise OlmoFormatError("BadKeyBase64", f"{name!r} is not canonical urlsafe base64 (padding or alphabet)")
    try:
        obj = restricted_loads(raw, allowed=frozenset())
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a format error here
        raise OlmoFormatError("BadKeyPickle", f"{name!r}: {type(e).__name__}: {e}")
    if not (isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], tuple) and type(obj[1]) is bool):
        raise OlmoFormatError("BadKeyPickle", f"{name!r} decodes to {obj!r}, not (tuple, bool)")
    keys, pickled = obj
    if not keys:
        raise OlmoFormatError("EmptyKeyPath", f"{name!r} decodes to an empty key path")
    for k in keys:
        if type(k) not in (str, int):
            raise OlmoFormatError("UnsupportedKeyType", f"{name!r}: key element {k!r} is a {type(k).__name__}")
    return keys, pickled


def canonical_name(keys, pickled):
    """The name OLMo's encode_key gives when equal strings in the path are one object (memoized)."""
    interned = {}
    ks = tuple(interned.setdefault(k, k) if isinstance(k, str) else k for k in keys)
    return base64.urlsafe_b64encode(pickle.dumps((ks, pickled), protocol=PICKLE_PROTOCOL)).decode("ascii")


def read_entries(path, strict=True):
    """-> (entries in file offset order, metadata). Raises OlmoFormatError / SafetensorsRuleError."""
    entries, metadata, _n, data_start, blob = torch_check.read_safetensors(path, strict)
    out = []
    for name, dtype, shape, s, e in entries:
        keys, pickled = decode_name(name)
        data = blob[data_start + s:data_start + e]
        raw = RawTensor(dtype, shape, data)
        value = raw
        if pickled:
            if dtype != "U8" or len(shape) != 1:
                raise OlmoFormatError("PickledNotU8", f"{keys!r}: a pickled value must be a 1-D U8 tensor, "
                                                      f"found {dtype}{shape}")
            try:
                value = restricted_loads(data)
            except Exception as ex:  # noqa: BLE001
                raise OlmoFormatError("BadValuePickle", f"{keys!r}: {type(ex).__name__}: {ex}")
            if isinstance(value, dict):  # OLMo walks dicts, it never pickles one
                raise OlmoFormatError("PickledDict", f"{keys!r}: a dict was pickled")
        out.append(Entry(name, keys, pickled, raw, value))
    return out, metadata


def unflatten(entries):
    """OLMo's unflatten_dict, with errors where OLMo would overwrite or corrupt silently."""
    result = {}
    seen = set()
    for ent in entries:
        tkey = tuple((type(k).__name__, k) for k in ent.keys)
        if tkey in seen:
            raise OlmoFormatError("DuplicateKeyPath", f"{ent.keys!r} appears twice")
        seen.add(tkey)
        target = result
        for i, k in enumerate(ent.keys[:-1]):
            nxt = target.get(k, _MISSING)
            if nxt is _MISSING:
                nxt = {}
                target[k] = nxt
            elif not isinstance(nxt, dict):  # pickled dicts are refused, so every dict here is a level
                raise OlmoFormatError("KeyPathConflict", f"{ent.keys!r}: {ent.keys[:i + 1]!r} is a leaf")
            target = nxt
        last = ent.keys[-1]
        if last in target:
            raise OlmoFormatError("KeyPathConflict", f"{ent.keys!r}: a dict already lives at this path")
        target[last] = ent.value
    return result


_MISSING = object()


def decode_file(path, strict=True):
    """-> (nested dict, entries in file order, metadata)."""
    entries, metadata = read_entries(path, strict)
    return unflatten(entries), entries, metadata


# --------------------------------------------------------------------------- checking
def _typed_key(k):
    return k if isinstance(k, (str, int)) and not isinstance(k, bool) else {"repr": repr(k)}


def check(path, manifest, strict=True, canonical=False):
    """Problems (one line each) between the file and a manifest written by gen_olmo_st.py."""
    from layouts._raw import flatten
    try:
        nested, entries, metadata = decode_file(path, strict)
    except (OlmoFormatError, torch_check.SafetensorsRuleError) as e:
        return [str(e)]
    except OSError as e:
        return [f"cannot read {path}: {e}"]
    problems = []
    try:
        tensors, values = flatten(nested)
    except ValueError as e:  # e.g. int key 1 and str key "1" in one dict
        return [f"AmbiguousName: {e}"]
    problems += torch_check.compare_with_manifest(manifest, tensors, values)

    want = manifest.get("olmo_entries")
    if want is not None:
        def ident(keys):
            return json.dumps(keys, ensure_ascii=False)

        got = {ident([_typed_key(k) for k in e.keys]): e for e in entries}
        exp = {ident(w["keys"]): w for w in want}
        for k in exp.keys() - got.keys():
            problems.append(f"entry {k} (pickled={exp[k]['pickled']}) missing or stored with other key types")
        for k in got.keys() - exp.keys():
            problems.append(f"unexpected entry {k} (pickled={got[k].pickled})")
        for k in exp.keys() & got.keys():
            w, e = exp[k], got[k]
            if w["pickled"] != e.pickled:
                problems.append(f"entry {k}: value_is_pickled {e.pickled}, expected {w['pickled']}")
            elif e.pickled and "repr" in w and repr(e.value) != w["repr"]:
                problems.append(f"entry {k}: pickled value {repr(e.value)[:120]} != expected {w['repr'][:120]}")
    if canonical:
        problems += check_canonical(path, entries, metadata)
    return problems


def check_canonical(path, entries, metadata):
    """The bytes OLMo + safetensors.save_file write for this content (names, pickles, header, order)."""
    problems = []
    if metadata is not None:
        problems.append(f"NotCanonical: __metadata__ {metadata} (OLMo's writer passes none)")
    for e in entries:
        want = canonical_name(e.keys, e.pickled)
        if e.name != want:
            problems.append(f"NotCanonical: {e.keys!r} is named {e.name!r}, the canonical encoding is {want!r}")
        if e.pickled:
            again = pickle.dumps(e.value, protocol=PICKLE_PROTOCOL)
            if again != e.tensor.data:
                problems.append(f"NotCanonical: {e.keys!r}: pickled bytes differ from pickle.dumps(value, protocol=4)")
    ents, meta, n, _start, blob = torch_check.read_safetensors(path, strict=False)
    problems += torch_check.check_canonical(ents, meta, n, blob)
    return problems
