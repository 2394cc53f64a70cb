#!/bin/sh
# Build the SGLang test environment (make sglang-env): SGLang without its CUDA
# dependencies, on the local CPU torch. Idempotent, run under a lock, so .ci/run can
# start it in the background while `make test` waits for it.
set -eu
venv=$1 version=$2 stamp=$1/.hurray-setup-$2
[ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt tools/sglang-requirements.txt ] && exit 0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q --no-deps "sglang==$version"
"$venv/bin/pip" install -q -c tools/sglang-constraints.txt -e ".[test]" -r tools/sglang-requirements.txt
touch "$stamp"
