"""Not torchvision: what two of SGLang's vision-language model configs
(``sglang.srt.multimodal.internvl_utils``, ``sglang.srt.configs.deepseek_ocr``) import
from it when ``sglang.srt.configs`` is imported, which SGLang's HiCache host pools do.
PyPI's torchvision is built against a CUDA torch and does not load beside the CPU torch
of this test environment (``operator torchvision::nms does not exist``). The SGLang
tests put this folder on ``PYTHONPATH``; no HiCache code calls it, and anything that
would use it raises. See docs/sglang.md."""

__version__ = "0.0.0+hurray-store-test-stand-in"
