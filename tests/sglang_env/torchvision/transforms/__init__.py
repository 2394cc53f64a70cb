"""Names SGLang's VL configs import at module level (see ``torchvision/__init__``)."""

from torchvision.transforms import functional
from torchvision.transforms.functional import InterpolationMode


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError(f"torchvision.transforms.{name}: not in the SGLang test environment")

    return unavailable


__all__ = ["InterpolationMode", "functional"]
