"""Names SGLang's VL configs import at module level (see ``torchvision/__init__``)."""

from torchvision import missing
from torchvision.transforms import functional
from torchvision.transforms.functional import InterpolationMode

__getattr__ = missing("torchvision.transforms")
__all__ = ["InterpolationMode", "functional"]
