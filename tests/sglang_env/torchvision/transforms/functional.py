"""``InterpolationMode``, imported by SGLang's VL configs (see ``torchvision/__init__``)."""

from enum import Enum


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BOX = "box"
    HAMMING = "hamming"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError(f"torchvision.transforms.functional.{name}: not available here")

    return unavailable
