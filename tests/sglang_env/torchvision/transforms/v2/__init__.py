"""Imported by transformers' image processors once it sees a torchvision (see
``torchvision/__init__``); never called in the SGLang tests."""

from torchvision.transforms import functional
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode", "functional"]
