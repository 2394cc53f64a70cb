#!/usr/bin/env python
"""Write the tiny random-weight Llama of ``hurray_store.tiny_model`` to OUT_DIR.

.venv/bin/python tools/make_tiny_model.py OUT_DIR [--dtype float32|float16|bfloat16] [--seed 0]
"""

from __future__ import annotations

import argparse

from hurray_store.tiny_model import DTYPES, build_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    build_tiny_model(a.out_dir, dtype=a.dtype, seed=a.seed)
    print(f"wrote a tiny Llama ({a.dtype}, seed {a.seed}) to {a.out_dir}")


if __name__ == "__main__":
    main()
