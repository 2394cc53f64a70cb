"""`hurray-store warmup` and `replay` over the tiny model: idempotence, bad corpus
lines, Redis, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hurray_store import PagedKVPool, tokenizer
from hurray_store.cli import main
from hurray_store.store import open_store
from hurray_store.testing.services import RedisProc
from hurray_store.tiny_model import build_tiny_model
from hurray_store.warmup import pool_pages, read_prompts

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model") / "tiny"
    build_tiny_model(str(d))
    return d


def corpus(path: Path, n: int = 12) -> Path:
    system = "You answer questions about the handbook below, briefly. " * 3
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"text": f"{system}Question {i}: what does part {i % 3} say?"}) + "\n"
            )
        f.write(
            json.dumps({"token_ids": tokenizer.encode(system, bos=True)[:50] + [7, 8, 9]}) + "\n"
        )
    return path


def disk_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "store.yaml"
    cfg.write_text(
        "tiers:\n  - {type: cpu, capacity_bytes: 268435456}\n  - "
        "{type: disk, path: cache, capacity_bytes: 1073741824}\n"
    )
    return cfg


def test_warmup_twice_writes_nothing_the_second_time(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, prompts = disk_config(tmp_path), corpus(tmp_path / "p.jsonl")
    args = [
        "warmup",
        "--config",
        str(cfg),
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--batch-size",
        "4",
        "--quiet",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "pages written" in first and "nothing new to write" not in first
    assert main(args) == 0
    second = capsys.readouterr().out
    assert "nothing new to write" in second
    skipped = next(line for line in second.splitlines() if line.startswith("prompts skipped"))
    assert skipped.split()[-1] == "13"  # every prompt: no model run at all


def test_warmed_cache_is_hit_by_the_api_for_the_same_model_dir(
    model_dir: Path, tmp_path: Path
) -> None:
    import asyncio

    from transformers import AutoModelForCausalLM

    from hurray_store.adapters.transformers import prefill_with_cache, run_model, spec_for_model

    cfg, prompts = disk_config(tmp_path), corpus(tmp_path / "p.jsonl")
    assert (
        main(
            [
                "warmup",
                "--config",
                str(cfg),
                "--model",
                str(model_dir),
                "--prompts",
                str(prompts),
                "--quiet",
            ]
        )
        == 0
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    spec = spec_for_model(model, page_size=16)
    ids, _ = read_prompts(prompts, vocab_size=tokenizer.VOCAB_SIZE)

    async def check() -> None:
        async with await open_store(cfg) as store:
            for p in ids:
                logits, _, reused = await prefill_with_cache(
                    model, store, PagedKVPool(spec, 64), p, store_result=False
                )
                assert reused == ((len(p) - 1) // 16) * 16
                full = run_model(model, torch.tensor([p]))[0]
                assert (logits - full[:, reused:]).abs().max().item() <= 1e-5

    asyncio.run(check())


def test_bad_corpus_lines_are_reported_by_line_and_skipped(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(
        '{"text": "a good prompt that is long enough to fill a page or two of tokens"}\n'
        "not json\n"
        '{"text": ""}\n'
        '{"token_ids": [1, 2, 99999]}\n'
        '{"token_ids": "abc"}\n'
        '{"text": "x", "token_ids": [1]}\n'
        "\n"
        '["a list"]\n'
        + '{"text": '
        + "[" * 100_000
        + "]" * 100_000
        + "}\n"
        + '{"text": "a lone surrogate \\ud800"}\n'
    )
    cfg = disk_config(tmp_path)
    assert (
        main(
            [
                "warmup",
                "--config",
                str(cfg),
                "--model",
                str(model_dir),
                "--prompts",
                str(p),
                "--quiet",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    for line, why in (
        (2, "not JSON"),
        (3, '"text" must be a non-empty string'),
        (4, "token id 99999 outside"),
        (5, '"token_ids" must be a non-empty list of integers'),
        (6, "expected an object with exactly one of"),
        (8, "expected an object"),
        (9, "JSON nested too deeply"),
        (10, '"text" is not encodable text'),
    ):
        assert f"bad.jsonl:{line}: {why}" in err, err
    assert "bad.jsonl:1:" not in err and "bad.jsonl:7:" not in err
    assert (
        main(
            [
                "warmup",
                "--config",
                str(cfg),
                "--model",
                str(model_dir),
                "--prompts",
                str(p),
                "--quiet",
                "--strict",
            ]
        )
        == 2
    )
    assert "aborting (--strict)" in capsys.readouterr().err


def test_warmup_into_redis(
    model_dir: Path, tmp_path: Path, redis_fresh: RedisProc, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "redis.yaml"
    cfg.write_text(
        f"tiers:\n  - {{type: cpu, capacity_bytes: 268435456}}\n  - "
        f"{{type: redis, url: '{redis_fresh.url}'}}\n"
    )
    prompts = corpus(tmp_path / "p.jsonl")
    assert (
        main(
            [
                "warmup",
                "--config",
                str(cfg),
                "--model",
                str(model_dir),
                "--prompts",
                str(prompts),
                "--quiet",
            ]
        )
        == 0
    )
    keys = redis_fresh.cli("--scan", "--pattern", "hurray:*").split()
    assert any(k.endswith("/m") for k in keys) and len(keys) >= 5
    capsys.readouterr()
    assert (
        main(
            [
                "warmup",
                "--config",
                str(cfg),
                "--model",
                str(model_dir),
                "--prompts",
                str(prompts),
                "--quiet",
            ]
        )
        == 0
    )
    assert (
        "nothing new to write" in capsys.readouterr().out
    )  # found again in Redis after the restart


def test_ctrl_c_leaves_only_committed_segments(model_dir: Path, tmp_path: Path) -> None:
    cfg = disk_config(tmp_path)
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for i in range(400):
            f.write(
                json.dumps(
                    {"text": f"Document {i % 40}: " + "lorem ipsum dolor " * 40 + f"question {i}"}
                )
                + "\n"
            )
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hurray_store.cli",
            "warmup",
            "--config",
            str(cfg),
            "--model",
            str(model_dir),
            "--prompts",
            str(big),
            "--quiet",
            "--batch-size",
            "2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Ctrl-C's default in the child, whatever the test run inherited: a shell's
        # background job starts with SIGINT ignored, and Python then never raises
        # KeyboardInterrupt (the warmup would run to its end and exit 0).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    objects = tmp_path / "cache" / "objects"
    while time.monotonic() < deadline and not (
        objects.exists() and sum(1 for _ in objects.rglob("*")) > 40
    ):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"interrupted" in err

    import asyncio

    from transformers import AutoModelForCausalLM

    from hurray_store.adapters.transformers import spec_for_model

    spec = spec_for_model(AutoModelForCausalLM.from_pretrained(str(model_dir)), page_size=16)
    ids, _ = read_prompts(big, vocab_size=tokenizer.VOCAB_SIZE)

    async def check() -> int:
        async with await open_store(cfg) as store:
            assert store.stats()["segments"] > 0
            hits = 0
            for p, want in zip(ids, await store.lookup(spec, ids), strict=True):
                if want:  # the prompts it got through: every indexed page is really there
                    pool = PagedKVPool(spec, 64)
                    got = await store.retrieve(pool, [p])
                    assert got.num_tokens == [want]
                    hits += 1
            return hits

    assert asyncio.run(check()) > 0


def test_the_pool_is_sized_by_what_a_batch_needs() -> None:
    """One 20,000-token prompt among short ones, batches of 64: the pool holds the 64
    largest prompts and the prefix read back, not 20,000 tokens times the batch size."""
    prompts = [[1] * 20_000] + [[2] * 100] * 500
    n = pool_pages(prompts, 16, 64)
    assert n == 1250 + 63 * 7 + 1250
    assert pool_pages([], 16, 8) == 1 and pool_pages([[1] * 17], 16, 8) == 2 + 2
