"""torch.save the way a GPU training job does, on a CPU-only machine.

Real DeepSpeed and OLMo checkpoints are saved from CUDA tensors, so each storage's pickled location
string is ``'cuda:<local_rank>'`` (torch/serialization.py ``location_tag``), except for tensors the
code moved to CPU first (DeepSpeed's ``frozen_param_fragments`` use ``.cpu()``; newer DeepSpeed clones
everything to CPU before saving, see ``debloat``).  ``save(obj, path, device=...)`` reproduces that by
registering a storage tagger ahead of torch's own for the duration of the call.  Files written this way
load with ``torch.load(..., map_location='cpu')``, exactly like the real ones.
"""
import contextlib

import torch
import torch.serialization as serialization

_ACTIVE = {"device": None, "cpu_ptrs": frozenset()}


def _tagger(storage):
    dev = _ACTIVE["device"]
    if dev is None:
        return None
    try:
        ptr = storage.data_ptr()
    except Exception:  # pragma: no cover - defensive
        return None
    if ptr in _ACTIVE["cpu_ptrs"]:
        return None
    return dev


def _deserializer(storage, location):
    # Only reached when this process loads without map_location: keep the data on the CPU.
    if isinstance(location, str) and location.startswith("cuda"):
        return storage
    return None


_registered = [False]


def _register():
    if not _registered[0]:
        serialization.register_package(5, _tagger, _deserializer)
        _registered[0] = True


def save(obj, path, device=None, cpu_tensors=()):
    """``torch.save(obj, path)``; storages get location ``device`` (e.g. ``'cuda:3'``) unless they back
    one of ``cpu_tensors`` (or ``device`` is None, then everything is ``'cpu'``)."""
    _register()
    _ACTIVE["device"] = device
    _ACTIVE["cpu_ptrs"] = frozenset(t.data_ptr() for t in cpu_tensors if t.numel() > 0)
    try:
        torch.save(obj, path)
    finally:
        _ACTIVE["device"] = None
        _ACTIVE["cpu_ptrs"] = frozenset()


def debloat(item):
    """Mirror of DeepSpeed's ``clone_tensors_for_torch_save`` (deepspeed/checkpoint/utils.py), which
    newer ``TorchCheckpointEngine.save`` applies to every checkpoint: each tensor is cloned to the CPU
    (storage sharing and views are gone), lists stay lists, **every tuple (including torch.Size)
    becomes a plain tuple**, and dicts are rebuilt with ``type(item)(...)`` (an OrderedDict loses its
    ``_metadata`` attribute)."""
    if torch.is_tensor(item):
        return item.detach().clone()
    if isinstance(item, list):
        return [debloat(v) for v in item]
    if isinstance(item, tuple):
        return tuple([debloat(v) for v in item])
    if isinstance(item, dict):
        return type(item)({k: debloat(v) for k, v in item.items()})
    return item


@contextlib.contextmanager
def nothing():
    yield
