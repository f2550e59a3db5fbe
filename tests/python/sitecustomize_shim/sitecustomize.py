"""Make torch 1.13's distributed modules importable on Python 3.11.

Python 3.11 rejects dataclass fields whose default is an unhashable instance
("mutable default <class ...TensorProperties> for field tensor_properties is
not allowed: use default_factory").  torch 1.13's
torch.distributed._shard.sharded_tensor.metadata declares exactly such a field,
so `import torch.distributed._shard` fails.

This module wraps dataclasses._get_field: when it raises that ValueError, the
offending default is replaced by an equivalent default_factory (returning a
shallow copy of the original default) and the field is processed again.

It works in two ways:
  * as a real `sitecustomize` (put this directory first on PYTHONPATH), so that
    every interpreter, including torch.multiprocessing.spawn children, gets it;
  * loaded explicitly by file path (see tests/python/_common.py), which is
    needed when another sitecustomize was already imported.
Installing it twice is harmless.
"""
import copy
import dataclasses

_FLAG = "_statedict_mutable_default_shim"


def _install():
    if getattr(dataclasses, _FLAG, False):
        return
    original = dataclasses._get_field

    def _get_field(cls, a_name, a_type, *args, **kwargs):
        try:
            return original(cls, a_name, a_type, *args, **kwargs)
        except ValueError as e:
            if "mutable default" not in str(e):
                raise
            current = getattr(cls, a_name, dataclasses.MISSING)
            if isinstance(current, dataclasses.Field):
                default = current.default
                extra = dict(init=current.init, repr=current.repr, hash=current.hash,
                             compare=current.compare, metadata=current.metadata)
                if hasattr(current, "kw_only"):
                    extra["kw_only"] = current.kw_only
            else:
                default, extra = current, {}
            setattr(cls, a_name, dataclasses.field(
                default_factory=lambda d=default: copy.copy(d), **extra))
            return original(cls, a_name, a_type, *args, **kwargs)

    dataclasses._get_field = _get_field
    setattr(dataclasses, _FLAG, True)


_install()

# Keep the system's own sitecustomize behaviour (Debian: apport hook), which a
# sitecustomize on PYTHONPATH would otherwise shadow.
try:  # pragma: no cover - depends on the host
    import apport_python_hook  # noqa: F401
except Exception:
    pass
else:
    try:
        apport_python_hook.install()
    except Exception:
        pass
