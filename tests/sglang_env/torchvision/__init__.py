"""Not torchvision: what two of SGLang's vision-language model configs
(``sglang.srt.multimodal.internvl_utils``, ``sglang.srt.configs.deepseek_ocr``) import
from it when ``sglang.srt.configs`` is imported, which SGLang's HiCache host pools do.
PyPI's torchvision is built against a CUDA torch and does not load beside the CPU torch
of this test environment (``operator torchvision::nms does not exist``). The SGLang
tests put this folder on ``PYTHONPATH``; no HiCache code calls it, and anything that
would use it raises. See docs/sglang.md."""

__version__ = "0.0.0+hurray-store-test-stand-in"


def missing(module: str):  # type: ignore[no-untyped-def]
    """A module ``__getattr__``: any name is a function that raises when called."""

    def __getattr__(name: str):  # type: ignore[no-untyped-def]
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError(f"{module}.{name}: not in the SGLang test environment")

        return unavailable

    return __getattr__
