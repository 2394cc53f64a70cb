"""The hurray-store command line: inspect, demo, and the server commands' failures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hurray_store import KVSpec
from hurray_store.cli import main
from hurray_store.cli.model_cmds import _pool_for
from hurray_store.format import encode_layer
from tests.helpers import make_layer
from tests.test_manifest import sample


def test_inspect_layer_object(tmp_path: Path, capsys) -> None:
    p = tmp_path / "layer.hrry"
    p.write_bytes(
        encode_layer(make_layer([[0, 1, 2], [0, 1, 3], [4]], 5, layer_index=6), quantization="int8")
    )
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    for needle in (
        "0x0A (block-paged)",
        "kv_role        key",
        "kv_role        value",
        "layer          6",
        "dtype          int8",
        "shape          [28, 2, 8]",
        "page_size      4",
        "num_pages      5",
        "num_seqs       3",
        "index type     uint32",
        "PerBlockAffine",
        "7 block-table entries over 5 distinct pages",
    ):
        assert needle in out, needle


def test_inspect_manifest(tmp_path: Path, capsys) -> None:
    p = tmp_path / "m.manifest"
    p.write_bytes(sample().to_bytes())
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert "segment manifest" in out and "sequences      2" in out and "layers         2" in out


def test_inspect_bad_file_prints_one_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.hrry"
    p.write_bytes(encode_layer(make_layer([[0, 1]], 2))[:-3])
    r = subprocess.run(
        [sys.executable, "-m", "hurray_store.cli", "inspect", str(p)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hurray-store inspect: error: {p}:")


def test_inspect_missing_file(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_demo_runs_and_checks(capsys) -> None:
    assert (
        main(
            [
                "codec-demo",
                "--layers",
                "2",
                "--seqs",
                "3",
                "--tokens",
                "64",
                "--heads",
                "2",
                "--dim",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "distinct pages stored" in out and out.count(" ok") == 2


def test_serve_with_a_bad_config_names_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tiers: [{type: cpu, capacity_bytes: 1024}]\nserver: {port: 99999}\n")
    r = subprocess.run(
        [sys.executable, "-m", "hurray_store.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "server.port" in r.stderr


def test_serve_on_a_taken_port_says_so(tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            "tiers: [{type: cpu, capacity_bytes: 1048576}]\nserver: {metrics_port: null}\n"
        )
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "hurray_store.cli",
                "serve",
                "--config",
                str(cfg),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1 and "cannot listen" in r.stderr
    assert f"the transport port 127.0.0.1:{port} (server.port, --port)" in r.stderr


def test_a_taken_metrics_port_is_named_as_the_metrics_port(tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            "tiers: [{type: cpu, capacity_bytes: 1048576}]\n"
            f"server: {{port: 0, metrics_host: 127.0.0.1, metrics_port: {port}}}\n"
        )
        r = subprocess.run(
            [sys.executable, "-m", "hurray_store.cli", "serve", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    assert f"the metrics port 127.0.0.1:{port} (server.metrics_port, --metrics-port)" in r.stderr


def test_version_and_a_bare_call_print_what_they_should(capsys) -> None:
    from hurray_store import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hurray-store {__version__}"
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hurray-store") and "check-config" in err and "--help" in err


def test_every_argument_of_every_command_has_help() -> None:
    import argparse

    from hurray_store.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {a.dest}"
        for name, p in sub.choices.items()
        for a in p._actions
        if not a.help and not isinstance(a, argparse._HelpAction)
    ]
    assert missing == [], missing
    no_example = [n for n, p in sub.choices.items() if "Example: hurray-store" not in p.description]
    assert no_example == [], no_example


def test_check_config_prints_the_resolved_config_or_names_the_bad_key(
    tmp_path: Path, capsys
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(f"tiers: [{{type: disk, path: {tmp_path / 'c'}, capacity_bytes: 1048576}}]\n")
    assert main(["check-config", str(good)]) == 0
    out = capsys.readouterr().out
    assert '"request_timeout_s": 30.0' in out or '"request_timeout_s"' in out  # defaults shown
    assert '"wait_s": 0.25' in out and "disk (disk): 1 MiB" in out and "valid" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{type: cpu, capacity_bytes: 1024}]\nengine: {wait_s: 0}\n")
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine.wait_s" in err[0], err


def test_a_model_job_checks_its_config_and_model_folder_before_loading_anything(
    tmp_path: Path, capsys
) -> None:
    """A typo in the config or the model folder is an error at once, before any model is
    loaded (with a real model that took minutes), and no Hub lookup happens."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{type: cpu, capacity_bytes: lots}]\n")
    argv = ["--prompts", "p.jsonl", "--model", str(tmp_path / "no-model")]
    for cmd in ("warmup", "replay"):
        assert main([cmd, "--config", str(bad), *argv]) == 2
        assert "tiers.cpu.capacity_bytes" in capsys.readouterr().err
        assert main([cmd, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no such model folder (nothing is downloaded)" in err[0], err


def test_stats_with_no_server(capsys) -> None:
    from hurray_store.testing.services import free_port

    assert main(["stats", "--url", f"hurray://127.0.0.1:{free_port()}"]) == 1
    assert "no answer" in capsys.readouterr().err


def test_server_token_from_the_environment() -> None:
    from hurray_store.config import load_config

    raw = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1},
            {"type": "remote", "url": "hurray://127.0.0.1:1"},
        ]
    }
    cfg = load_config(
        raw,
        env={"HURRAY_STORE__SERVER__TOKEN": "from-env", "HURRAY_STORE__TIERS__REMOTE__TOKEN": "t2"},
    )
    assert cfg.server.token == "from-env" and cfg.tiers[1].token == "t2"  # type: ignore[union-attr]


def _bad_input_case(case: str, tmp_path: Path) -> list[str]:
    """The argv of one bad input, its files made under ``tmp_path``."""
    if case == "config_not_utf8":
        p = tmp_path / "bad.yaml"
        p.write_bytes(b"tiers:\n  - {type: cpu, capacity_bytes: \xff\xfe}\n")
        return ["serve", "--config", str(p), "--port", "0"]
    if case == "config_capacity_the_machine_cannot_map":
        p = tmp_path / "huge.yaml"
        p.write_text("tiers:\n  - {type: cpu, capacity_bytes: 1152921504606846976}\n")
        return ["serve", "--config", str(p), "--port", "0"]
    if case == "config_missing":
        return ["serve", "--config", str(tmp_path / "nope.yaml"), "--port", "0"]
    if case == "serve_port_out_of_range":
        return ["serve", "--port", "99999"]
    if case == "serve_metrics_port_out_of_range":
        return ["serve", "--port", "0", "--metrics-port", "70000"]
    if case == "warmup_batch_size_zero":
        return ["warmup", "--model", "m", "--prompts", "p.jsonl", "--batch-size", "0"]
    if case == "warmup_page_size_not_a_number":
        return ["warmup", "--model", "m", "--prompts", "p.jsonl", "--page-size", "x"]
    if case == "warmup_without_a_model":
        return ["warmup", "--prompts", "p.jsonl"]
    if case == "demo_negative_layers":
        return ["codec-demo", "--layers", "-1"]
    configs = {
        "config_nested_too_deeply": "tiers: " + "[" * 5000 + "]" * 5000 + "\n",
        "config_python_tag": "!!python/object:os.system ls\n",
        "config_nan_timeout": (
            "tiers: [{type: cpu, capacity_bytes: 1000}]\nserver: {request_timeout_s: .nan}\n"
        ),
        "config_nul_in_a_path": 'tiers: [{type: disk, path: "\\0x", capacity_bytes: 1000}]\n',
        "config_bad_namespace": "namespace: a/o/b\ntiers: [{type: cpu, capacity_bytes: 1000}]\n",
    }
    if case in configs:
        p = tmp_path / "bad.yaml"
        p.write_text(configs[case])
        return ["serve", "--config", str(p), "--port", "0"]
    if case == "stats_url_not_hurray":
        return ["stats", "--url", "http://127.0.0.1:1"]
    if case == "stats_url_without_port":
        return ["stats", "--url", "hurray://127.0.0.1"]
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "config_not_utf8",
        "config_capacity_the_machine_cannot_map",
        "config_missing",
        "stats_url_not_hurray",
        "stats_url_without_port",
        "serve_port_out_of_range",
        "serve_metrics_port_out_of_range",
        "warmup_batch_size_zero",
        "warmup_page_size_not_a_number",
        "warmup_without_a_model",
        "demo_negative_layers",
        "config_nested_too_deeply",
        "config_python_tag",
        "config_nan_timeout",
        "config_nul_in_a_path",
        "config_bad_namespace",
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(case: str, tmp_path: Path, capsys) -> None:
    argv = _bad_input_case(case, tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hurray-store {argv[0]}"), err


def test_a_pool_the_machine_cannot_allocate_is_a_clear_error() -> None:
    """warmup/replay with a page size whose pool cannot be allocated: a ValueError that
    says what was asked for (the CLI prints it as one line, exit code 2)."""
    spec = KVSpec(
        model="m",
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        page_size=1 << 32,
        dtype=torch.float16,
    )
    with pytest.raises(
        ValueError, match=r"cannot allocate the KV pool: \d+ pages of 4294967296 tokens"
    ):
        _pool_for(spec, [[1, 2, 3]], 1)
