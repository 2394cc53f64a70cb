"""``InterpolationMode``, imported by SGLang's VL configs (see ``torchvision/__init__``)."""

from enum import Enum

from torchvision import missing


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BOX = "box"
    BILINEAR = "bilinear"
    HAMMING = "hamming"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


__getattr__ = missing("torchvision.transforms.functional")
