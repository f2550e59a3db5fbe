"""Stand-in classes that carry the module and qualified names DeepSpeed and PyTorch FSDP pickle.

Real DeepSpeed checkpoints pickle a handful of DeepSpeed objects.  DeepSpeed cannot be installed
here, so this module creates throw-away modules in ``sys.modules`` under the real module names and
defines classes with the real qualified names.  ``pickle`` then writes the very same ``GLOBAL``
opcodes a real file holds (``GLOBAL 'deepspeed.runtime.zero.config ZeroStageEnum'`` and so on), and
``torch.load`` can read the files back in this process.

Nothing here imports DeepSpeed or FSDP; ``install()`` must run before anything is pickled.
Where each name comes from (see docs/notes/zero-fsdp-layouts.md for the full citations):
  deepspeed/runtime/zero/config.py          ZeroStageEnum(int, Enum)
  deepspeed/runtime/fp16/loss_scaler.py     LossScaler, DynamicLossScaler (both LossScalerBase subclasses)
  deepspeed/runtime/config_utils.py         DeepSpeedConfigObject (base class of the loss scalers)
  deepspeed/utils/tensor_fragment.py        fragment_address dataclass (param_slice_mappings values)
  torch/distributed/fsdp/_flat_param.py     _ShardParamInfo NamedTuple (torch >= 2.1 flat param metadata)
"""
import sys
import types
import enum
import dataclasses
from typing import NamedTuple, Optional

_installed = {}


def _module(name):
    """Return a throw-away module registered under ``name`` (parents are created lazily, never imported)."""
    if name in sys.modules and name in _installed:
        return sys.modules[name]
    if name in sys.modules:
        # A real module of that name exists (torch.distributed...): never touch it.
        raise RuntimeError(f"refusing to shadow real module {name}")
    mod = types.ModuleType(name)
    mod.__file__ = f"<stand-in for {name}>"
    sys.modules[name] = mod
    _installed[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        if parent in sys.modules:
            if parent in _installed:
                setattr(sys.modules[parent], child, mod)
        else:
            setattr(_module(parent), child, mod)
    return mod


def _place(cls, module_name):
    mod = _module(module_name)
    cls.__module__ = module_name
    setattr(mod, cls.__qualname__, cls)
    return cls


# deepspeed/runtime/config_utils.py: the loss scalers derive from this plain object base.
class DeepSpeedConfigObject(object):
    def repr(self):
        return self.__dict__


# deepspeed/runtime/zero/config.py
class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


# How an Enum member is pickled depends on the Python that wrote the file, not on DeepSpeed:
# Python <= 3.10 writes ``REDUCE(GLOBAL ZeroStageEnum, (2,))`` (by value); Python >= 3.11 writes
# ``REDUCE(GLOBAL __builtin__ getattr, (GLOBAL ZeroStageEnum, 'gradients'))`` (by name).
# ``set_enum_pickle_style`` lets one generator run produce both.
_ENUM_BY_VALUE = [False]
_default_enum_reduce = enum.Enum.__reduce_ex__


def _zero_stage_reduce_ex(self, proto):
    if _ENUM_BY_VALUE[0]:
        return self.__class__, (self._value_,)
    return _default_enum_reduce(self, proto)


ZeroStageEnum.__reduce_ex__ = _zero_stage_reduce_ex


def set_enum_pickle_style(by_value):
    _ENUM_BY_VALUE[0] = bool(by_value)


# deepspeed/runtime/fp16/loss_scaler.py.  Only the attribute names and their insertion order matter:
# pickle writes __dict__ as the BUILD state.
class LossScalerBase(DeepSpeedConfigObject):
    def __init__(self, cur_scale):
        super().__init__()
        self.cur_scale = cur_scale
        self.dynamic = False


class LossScaler(LossScalerBase):
    def __init__(self, scale=1):
        super().__init__(scale)


class DynamicLossScaler(LossScalerBase):
    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                 raise_error_at_min_scale=True, dtype=None):
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dynamic = True
        self.dtype = dtype


# deepspeed/utils/tensor_fragment.py
@dataclasses.dataclass
class fragment_address:
    numel: int
    start: int


# torch/distributed/fsdp/_flat_param.py (torch >= 2.1).  torch 1.13 has no such module.
class _ShardParamInfo(NamedTuple):
    in_shard: bool
    offset_in_shard: Optional[int]
    numel_in_shard: Optional[int]
    intra_param_start_idx: Optional[int]
    intra_param_end_idx: Optional[int]


FLAT_PARAM_MODULE = "torch.distributed.fsdp._flat_param"


def install():
    """Register every stand-in module and class (idempotent)."""
    if _installed:
        return
    _place(DeepSpeedConfigObject, "deepspeed.runtime.config_utils")
    _place(ZeroStageEnum, "deepspeed.runtime.zero.config")
    _place(LossScalerBase, "deepspeed.runtime.fp16.loss_scaler")
    _place(LossScaler, "deepspeed.runtime.fp16.loss_scaler")
    _place(DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler")
    _place(fragment_address, "deepspeed.utils.tensor_fragment")
    # torch.distributed is a real package: register only the leaf name, never its parents.
    if FLAT_PARAM_MODULE in sys.modules and FLAT_PARAM_MODULE not in _installed:
        raise RuntimeError(f"{FLAT_PARAM_MODULE} already exists; run with torch 1.13")
    mod = types.ModuleType(FLAT_PARAM_MODULE)
    mod.__file__ = f"<stand-in for {FLAT_PARAM_MODULE}>"
    sys.modules[FLAT_PARAM_MODULE] = mod
    _installed[FLAT_PARAM_MODULE] = mod
    _ShardParamInfo.__module__ = FLAT_PARAM_MODULE
    mod._ShardParamInfo = _ShardParamInfo
