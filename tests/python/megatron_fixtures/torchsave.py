"""torch.save with the storage locations a GPU job writes, on a CPU-only machine.

Megatron saves model parameters, optimizer state and the fp32 master copies straight from the GPU,
so their storages are pickled with location ``'cuda:<local rank>'`` (torch/serialization.py
``location_tag``); the RNG states (``torch.get_rng_state()`` and friends) and the distributed
optimizer's gathered buffers (built with ``device="cpu"``) are CPU tensors.  ``save(obj, path,
cuda=...)`` tags every storage with the given location except those backing ``cpu_tensors``.
Such files load with ``torch.load(path, map_location="cpu")``, as real ones do on a CPU host.
"""
import torch
import torch.serialization as serialization

_STATE = {"location": None, "cpu": frozenset()}
_REGISTERED = []


def _tag(storage):
    loc = _STATE["location"]
    if loc is None:
        return None
    if storage.data_ptr() in _STATE["cpu"]:
        return None
    return loc


def _restore(storage, location):
    # Reached only when loading without map_location in a process that has this module:
    # keep CUDA-tagged storages on the CPU.
    if isinstance(location, str) and location.startswith("cuda"):
        return storage
    return None


def save(obj, path, cuda=None, cpu_tensors=()):
    if not _REGISTERED:
        serialization.register_package(4, _tag, _restore)
        _REGISTERED.append(True)
    _STATE["location"] = cuda
    _STATE["cpu"] = frozenset(t.data_ptr() for t in cpu_tensors if t.numel() > 0)
    try:
        torch.save(obj, path)
    finally:
        _STATE["location"] = None
        _STATE["cpu"] = frozenset()
