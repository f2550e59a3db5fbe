"""Classes the training-framework-shaped fixtures of objects_check.py pickle (an enum and meters,
as fairseq and metaseq keep them in their checkpoints); importable so that torch.load of the
original files, with weights_only=False, can rebuild them."""
import enum


class Precision(enum.Enum):
    FP16 = "fp16"
    BF16 = "bf16"


class AverageMeter:
    def __init__(self, val=0.0, count=0):
        self.val = val
        self.sum = val * count
        self.count = count
        self.round = 3

    def __eq__(self, other):
        return type(other) is type(self) and vars(other) == vars(self)


class StopwatchMeter:
    def __init__(self, elapsed=0.0):
        self.sum = elapsed
        self.n = 1
        self.start_time = None

    def __eq__(self, other):
        return type(other) is type(self) and vars(other) == vars(self)
