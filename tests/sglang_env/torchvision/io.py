"""Imported by transformers' video utilities once it sees a torchvision (see
``torchvision/__init__``); never called in the SGLang tests."""


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError(f"torchvision.io.{name}: not in the SGLang test environment")

    return unavailable
