"""Classes that the "objects beyond the weights_only allow-list" fixtures pickle by reference
(gen_t2_objects.py). Files that hold them load with torch.load(weights_only=False) only where
this module is importable, as a training framework's own classes would."""
import enum


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Stage(enum.IntEnum):
    PRETRAIN = 1
    FINETUNE = 2
