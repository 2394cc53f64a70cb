"""See ``torchvision/__init__``: names only, nothing here is called."""

from torchvision.transforms.functional import InterpolationMode, __getattr__  # noqa: F401
