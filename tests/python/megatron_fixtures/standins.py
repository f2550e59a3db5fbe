"""Stand-ins for the Megatron-LM classes a checkpoint pickles by name.

A Megatron checkpoint's ``args`` (an ``argparse.Namespace``) holds ``model_type``, a member of
``megatron.core.enums.ModelType`` (megatron/core/enums.py, an ``enum.Enum``; core_v0.8.0 numbers it
encoder_or_decoder=1, encoder_and_decoder=2, retro_encoder=3, retro_decoder=4, core_v0.15.0 drops
encoder_and_decoder and renumbers retro_encoder=2, retro_decoder=3).  So the pickle names the global
``megatron.core.enums ModelType``.  Megatron is not importable here: ``install()`` registers a
throw-away module under that name whose ``ModelType`` carries the real module and qualified name,
so ``pickle`` writes the same GLOBAL opcode a real file holds, and ``torch.load`` can read the file
back in this process.

How an Enum member is pickled depends on the Python that wrote the file: Python <= 3.10 writes
``REDUCE(GLOBAL ModelType, (1,))`` (by value), Python >= 3.11 writes
``REDUCE(GLOBAL builtins getattr, (GLOBAL ModelType, 'encoder_or_decoder'))`` (by name).
``enum_by_value(True)`` makes this process write the older form.
"""
import enum
import sys
import types

_own = {}


def _module(name):
    if name in _own:
        return _own[name]
    if name in sys.modules:
        raise RuntimeError(f"refusing to shadow the real module {name}")
    mod = types.ModuleType(name)
    mod.__file__ = f"<statedict stand-in for {name}>"
    sys.modules[name] = mod
    _own[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_module(parent), child, mod)
    return mod


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


_BY_VALUE = [False]
_enum_reduce_ex = enum.Enum.__reduce_ex__


def _model_type_reduce_ex(self, proto):
    if _BY_VALUE[0]:
        return self.__class__, (self._value_,)
    return _enum_reduce_ex(self, proto)


ModelType.__reduce_ex__ = _model_type_reduce_ex


def enum_by_value(flag):
    _BY_VALUE[0] = bool(flag)


def install():
    """Register ``megatron.core.enums.ModelType`` (idempotent).  Call before pickling or loading."""
    if "megatron.core.enums" in _own:
        return
    mod = _module("megatron.core.enums")
    ModelType.__module__ = "megatron.core.enums"
    ModelType.__qualname__ = "ModelType"
    mod.ModelType = ModelType
