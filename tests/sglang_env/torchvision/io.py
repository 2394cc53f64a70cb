"""Imported by transformers' video utilities once it sees a torchvision (see
``torchvision/__init__``); never called in the SGLang tests."""

from torchvision import missing

__getattr__ = missing("torchvision.io")
