"""The SGLang HiCache backend against SGLang 0.5.23's own classes (host pools on CPU
tensors, ``HiCacheStorageConfig``, the backend factory), each case in processes of the
SGLang environment (``tests/sglang_cases.py``); a store shared through a disk folder or
a real ``hurray-store serve``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import hurray
import pytest
import torch
import yaml
from safetensors.torch import save_file

from hurray_store.cli.format_cmds import inspect_bytes
from tests.server_helpers import ServerProc

ROOT = Path(__file__).resolve().parent.parent
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
PER_LAYER = [x for x in LAYOUTS if x != "page_first"]  # page_first's objects are token-major
DTYPES = ["float16", "bfloat16", "float32"]

pytestmark = pytest.mark.skipif(
    not SGLANG_PY.exists(), reason=".venv-sglang missing: `make sglang-env` builds it"
)


def sglang(spec: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """Run one case (or a batch of them) in a fresh SGLang process; what it saw."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "sglang_env"), str(ROOT)]),
        "SGLANG_LOGGING_LEVEL": "WARNING",
    }
    p = subprocess.run(
        [str(SGLANG_PY), str(ROOT / "tests" / "sglang_cases.py"), json.dumps(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out: dict[str, Any] = json.loads(line[len("RESULT ") :])
    out["log"] = p.stderr
    return out


def model(d: Path, seed: int) -> str:
    """A model folder: a config and weights (same geometry, weights from ``seed``)."""
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(16, 16, generator=g)}, str(d / "model.safetensors"))
    cfg = {"model_type": "llama", "num_hidden_layers": 3, "num_key_value_heads": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def disk_config(tmp: Path) -> str:
    p = tmp / "store.yaml"
    cfg = {"tiers": [{"type": "disk", "path": str(tmp / "cache"), "capacity_bytes": 1 << 30}]}
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def page_files(tmp: Path) -> list[Path]:
    return sorted(f for f in (tmp / "cache" / "objects").rglob("*") if f.is_file())


def keys(tag: str, n: int) -> list[str]:
    return [f"{tag}{i:02d}" for i in range(n)]


def reader_of(layout: str, shift: int) -> str:
    """A layout to read pages written in ``layout`` in: another of the per-layer
    layouts, or ``page_first`` itself (its pages are named apart)."""
    if layout not in PER_LAYER:
        return layout
    return PER_LAYER[(PER_LAYER.index(layout) + shift) % len(PER_LAYER)]


@pytest.fixture
def served(tmp_path: Path) -> Any:
    srv = ServerProc(tmp_path / "server").start()
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(yaml.safe_dump({"tiers": [srv.tier(timeout_s=2.0)]}))
    try:
        yield srv, str(cfg)
    finally:
        srv.kill()


def _matrix(cfg: str, mdl: str) -> None:
    """Pages set by one process in each layout, dtype and page size are read bit-exact
    by a fresh process (in another layout of the same object form); ``batch_exists``
    counts the leading run."""
    sets, gets = [], []
    for dt in DTYPES:
        for P in (16, 64):
            for layout in LAYOUTS:
                k = keys(f"{dt[:2]}{P}{layout[:6]}", 3)
                sets.append({"op": "set", "keys": k, "layout": layout, "dtype": dt, "page_size": P})
                # read in another layout than it was written in, then one key absent
                other = reader_of(layout, 1)
                gets.append(
                    {
                        "op": "get",
                        "keys": [*k, "absent"],
                        "layout": other,
                        "dtype": dt,
                        "page_size": P,
                    }
                )
    base = {"config": cfg, "model": mdl}
    wrote = sglang({**base, "op": "batch", "runs": sets})["runs"]
    assert all(r["set"] == [True] * 3 and not r["disabled"] for r in wrote), wrote
    read = sglang({**base, "op": "batch", "runs": gets})["runs"]
    for g, r in zip(gets, read, strict=True):
        assert r["exists"] == 3, (g, r)
        assert r["get"] == [True, True, True, False], (g, r)
        assert r["equal"] == [True, True, True, False], (g, r)
        assert r["untouched"][3], (g, r)


def test_every_layout_dtype_and_page_size_round_trips_through_a_shared_disk_folder(
    tmp_path: Path,
) -> None:
    _matrix(disk_config(tmp_path), model(tmp_path / "m", 1))


def test_every_layout_dtype_and_page_size_round_trips_through_the_cache_server(
    tmp_path: Path, served: Any
) -> None:
    _matrix(served[1], model(tmp_path / "m", 1))


def test_batch_exists_counts_exactly_the_leading_run_stored(tmp_path: Path) -> None:
    base = {"config": disk_config(tmp_path), "model": model(tmp_path / "m", 1)}
    k = keys("run", 6)
    sglang({**base, "op": "set", "keys": [k[0], k[1], k[3]]})
    got = sglang(
        {
            **base,
            "op": "batch",
            "runs": [
                {"op": "get", "keys": k},  # 0, 1 held, 2 not: 2 (3 is not counted)
                {"op": "get", "keys": [k[3]]},
                {"op": "get", "keys": [k[2], k[3]]},
            ],
        }
    )["runs"]
    assert [r["exists"] for r in got] == [2, 1, 0]
    assert got[0]["get"] == [True, True, False, False, False, False]
    assert got[0]["untouched"][2:] == [True] * 4


def test_pages_named_again_with_a_partial_overlap_write_only_the_missing_ones(
    tmp_path: Path,
) -> None:
    base = {"config": disk_config(tmp_path), "model": model(tmp_path / "m", 1)}
    k = keys("ov", 5)
    first = sglang({**base, "op": "set", "keys": k[:3]})
    assert first["counts"]["pages_written"] == 3
    files = {f.name: f.stat().st_mtime_ns for f in page_files(tmp_path)}
    second = sglang({**base, "op": "set", "keys": k[1:]})
    assert second["set"] == [True] * 4
    assert (second["counts"]["pages_written"], second["counts"]["pages_deduplicated"]) == (2, 2)
    after = {f.name: f.stat().st_mtime_ns for f in page_files(tmp_path)}
    assert all(after[n] == t for n, t in files.items())  # the held pages were not rewritten
    assert len(after) == len(files) + 2


DAMAGES = ("corrupt", "truncated", "deleted")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four pages per kind of damage set (one process, which also names them), the
    second page of each damaged on disk, then each read again (another process: each
    a backend of its own), the corrupt one twice."""
    tmp = tmp_path_factory.mktemp("sglang-damaged")
    base = {"config": disk_config(tmp), "model": model(tmp / "m", 1)}
    ks = {d: keys(f"dm-{d}", 4) for d in DAMAGES}
    runs = [{"op": "set", "keys": k} for k in ks.values()]
    runs += [{"op": "get", "keys": k} for k in ks.values()]
    names = [r["names"] for r in sglang({**base, "op": "batch", "runs": runs})["runs"][3:]]
    for damage, got in zip(DAMAGES, names, strict=True):
        (victim,) = [f for f in page_files(tmp) if f.name.endswith(got[1].replace("/", "%2F"))]
        raw = bytearray(victim.read_bytes())
        if damage == "corrupt":
            raw[-400] ^= 0x40  # a byte of the last layer's value pool (the record is 162 bytes)
            victim.write_bytes(bytes(raw))
        elif damage == "truncated":
            victim.write_bytes(bytes(raw[: len(raw) // 2]))
        else:
            victim.unlink()
    again = [{"op": "get", "keys": ks[d]} for d in (*DAMAGES, "corrupt")]
    after = sglang({**base, "op": "batch", "runs": again})["runs"]
    return {**dict(zip(DAMAGES, after, strict=False)), "again": after[3]}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_page_object_is_a_miss_from_that_page_on(
    damaged: dict[str, Any], damage: str
) -> None:
    got = damaged[damage]
    assert got["get"] == [True, False, False, False]
    assert got["equal"][0] and got["untouched"][1:] == [True, True, True]
    if damage == "corrupt":  # read, found wrong, dropped: the next lookup does not count it
        assert got["counts"]["pages_rejected"] == 1
        again = damaged["again"]
        assert again["exists"] == 1 and again["get"] == [True, False, False, False]


def test_two_models_of_one_geometry_never_share_a_page(tmp_path: Path) -> None:
    cfg = disk_config(tmp_path)
    a, b = model(tmp_path / "a", 1), model(tmp_path / "b", 2)
    k = keys("id", 3)
    runs = [{"op": "set", "model": a}, {"op": "get", "model": a}, {"op": "get", "model": b}]
    got = sglang({"config": cfg, "op": "batch", "keys": k, "runs": runs})["runs"][1:]
    assert [r["exists"] for r in got] == [3, 0]
    assert got[0]["get"] == [True] * 3 and all(got[0]["equal"])
    assert got[1]["get"] == [False] * 3 and all(got[1]["untouched"])


def test_page_first_pages_are_a_miss_in_a_per_layer_layout_and_the_other_way_round(
    tmp_path: Path,
) -> None:
    base = {"config": disk_config(tmp_path), "model": model(tmp_path / "m", 1)}
    tm, pl = keys("tm", 2), keys("pl", 2)
    wrote = sglang(
        {
            **base,
            "op": "batch",
            "runs": [
                {"op": "set", "keys": tm, "layout": "page_first"},
                {"op": "set", "keys": pl, "layout": "layer_first"},
            ],
        }
    )["runs"]
    assert [r["set"] for r in wrote] == [[True, True]] * 2
    got = sglang(
        {
            **base,
            "op": "batch",
            "runs": [
                {"op": "get", "keys": tm, "layout": layout}
                for layout in ("layer_first", "page_first_direct", "page_head")
            ]
            + [
                {"op": "get", "keys": pl, "layout": "page_first"},
                {"op": "get", "keys": tm, "layout": "page_first"},
            ],
        }
    )["runs"]
    for r in got[:4]:  # the other form's pages: misses, the pool untouched
        assert r["exists"] == 0 and r["get"] == [False, False] and all(r["untouched"]), r
    assert got[4]["get"] == [True, True] and got[4]["equal"] == [True, True]
    # The page_first object is one K and one V descriptor of every layer's heads.
    files = page_files(tmp_path)
    objs = [f for n in got[4]["names"] for f in files if f.name.endswith(n.replace("/", "%2F"))]
    assert len(objs) == 2
    tensors = list(hurray.StreamReader(objs[0].read_bytes()))
    assert len(tensors) == 3 and tuple(tensors[0].shape) == (16, 3 * 2, 16)
    assert "chunk object" in inspect_bytes(objs[0].read_bytes())


def test_the_legacy_flat_page_calls_round_trip_in_every_layout(tmp_path: Path) -> None:
    base = {"config": disk_config(tmp_path), "model": model(tmp_path / "m", 1), "legacy": True}
    runs = []
    for i, layout in enumerate(LAYOUTS):
        k = keys(f"lg{i}", 2)
        runs.append({"op": "set", "keys": k, "layout": layout})
        runs.append({"op": "get", "keys": [*k, "nope"], "layout": reader_of(layout, 2)})
    got = sglang({**base, "op": "batch", "runs": runs})["runs"]
    for s, g in zip(got[::2], got[1::2], strict=True):
        assert s["set"] is True
        assert g["get"] == [True, True, False] and g["equal"] == [True, True, False]


def test_the_server_killed_mid_get_is_misses_and_no_exception(tmp_path: Path, served: Any) -> None:
    srv, cfg = served
    base = {"config": cfg, "model": model(tmp_path / "m", 1), "page_size": 64}
    k = keys("kill", 96)
    assert sglang({**base, "op": "set", "keys": k})["set"] == [True] * 96
    assert srv.proc is not None
    got = sglang({**base, "op": "get", "keys": k, "kill_pid": srv.proc.pid, "kill_after_s": 0.0})
    n = got["get"].count(True)
    assert got["get"] == [True] * n + [False] * (96 - n)
    assert got["equal"][:n] == [True] * n and all(got["untouched"][n:])
    # and with the server gone: misses, no exception
    gone = sglang({**base, "op": "get", "keys": k[:4]})
    assert gone["exists"] == 0 and gone["get"] == [False] * 4


def test_a_store_that_is_down_is_misses_and_failed_sets_never_an_exception(
    tmp_path: Path,
) -> None:
    from hurray_store.testing.services import free_port

    cfg = tmp_path / "down.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"type": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "timeout_s": 0.5}
                ]
            }
        )
    )
    base = {"config": str(cfg), "model": model(tmp_path / "m", 1)}
    got = sglang(
        {**base, "op": "batch", "keys": keys("dn", 2), "runs": [{"op": "set"}, {"op": "get"}]}
    )["runs"]
    assert got[0]["set"] == [False, False]
    assert got[1]["exists"] == 0 and got[1]["get"] == [False, False]


def test_mla_models_construct_and_a_model_name_warns_once(tmp_path: Path) -> None:
    base = {"config": disk_config(tmp_path), "model": model(tmp_path / "m", 1)}
    runs = [{"op": "construct", "mla": True}, {"op": "construct"}]
    got = sglang({**base, "op": "batch", "runs": runs})
    assert [r["error"] for r in got["runs"]] == ["", ""]
    assert "is not a model folder" not in got["log"]
    # A model that is no folder and no model_path: a name, with a warning
    named = sglang(
        {"config": base["config"], "op": "construct", "model": None, "model_name": "some/name"}
    )
    assert named["error"] == "" and "is not a model folder" in named["log"]


def test_page_objects_decode_with_pyhurray_and_hurray_store_inspect(tmp_path: Path) -> None:
    base = {"config": disk_config(tmp_path), "model": model(tmp_path / "m", 1), "page_size": 16}
    runs = [
        {"op": "set", "keys": ["insp"], "dtype": "bfloat16"},
        {"op": "set", "keys": ["inspmla"], "mla": True},  # an MLA page
    ]
    sglang({**base, "op": "batch", "runs": runs})
    (obj,) = [f for f in page_files(tmp_path) if f.name.endswith("insp")]
    raw = obj.read_bytes()
    tensors = list(hurray.StreamReader(raw))
    assert len(tensors) == 2 * 3 + 1  # per layer K and V, then the record
    assert [t.layout.kv_role for t in tensors[:2]] == ["key", "value"]
    assert tensors[0].layout.page_size == 16 and tensors[0].layout.num_pages == 1
    text = inspect_bytes(raw)
    assert "chunk object" in text and "3 layers" in text and "HSLC" in text
    # the MLA page: one fused descriptor of the latent per layer
    (mla,) = [f for f in page_files(tmp_path) if f.name.endswith("inspmla")]
    tensors = list(hurray.StreamReader(mla.read_bytes()))
    assert [t.layout.kv_role for t in tensors[:3]] == ["fused"] * 3 and len(tensors) == 4
    assert "chunk object" in inspect_bytes(mla.read_bytes())
    p = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "hurray-store"), "inspect", str(obj)],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0 and "chunk object" in p.stdout


def test_sglangs_pages_are_published_as_kv_events_keyed_by_its_page_hashes(
    tmp_path: Path,
) -> None:
    """SGLang's real host pool through the backend, with ``events`` in the store's YAML:
    each page set is a ``BlockStored`` of the STORAGE medium (a disk tier) keyed by
    SGLang's own page hash, under ``kv@<instance>@<model>``."""
    from hurray_store.events.subscriber import Subscriber
    from hurray_store.testing.services import free_port

    ep = f"tcp://127.0.0.1:{free_port()}"
    cfg = tmp_path / "store.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"type": "disk", "path": str(tmp_path / "cache"), "capacity_bytes": 1 << 30}
                ],
                "events": {"endpoint": ep, "instance": "node-1", "interval_ms": 1500},
            }
        )
    )
    page_keys = [f"{i:064x}" for i in range(3)]  # SGLang's sha256 page hashes, in hex
    sub = Subscriber(ep, "kv@node-1@")
    try:
        sglang(
            {
                "config": str(cfg),
                "model": model(tmp_path / "m", 1),
                "model_name": "qwen-test",
                "op": "set",
                "keys": page_keys,
                "settle_s": 2.0,  # the subscriber joins the PUB socket first
            }
        )
        got = []
        while len([e for r in got for e in r.batch.events]) < 3:
            more = sub.recv(10)
            assert more, "the events never came"
            got += more
    finally:
        sub.close()
    assert {r.topic for r in got} == {"kv@node-1@qwen-test"}
    evs = [e for r in got for e in r.batch.events]
    assert {type(e).__name__ for e in evs} == {"BlockStored"}
    assert sorted(h.hex() for e in evs for h in e.block_hashes) == page_keys
    assert {(e.medium, e.ownership, e.block_size) for e in evs} == {("STORAGE", "disk", 16)}


def test_sglangs_argument_rules_are_enforced_and_calls_after_close_return_at_once(
    tmp_path: Path,
) -> None:
    """Float host indices, more indices than pages, a page's indices out of order and a
    key named twice in one set: each is one ERROR line and nothing stored (all False);
    the good call after them stores. After ``close()`` every call is a miss at once
    (it used to wait 60 s for a loop that was gone; the bound here is a hang guard)."""
    got = sglang(
        {
            "config": disk_config(tmp_path),
            "model": model(tmp_path / "m", 1),
            "op": "bad_args",
        }
    )
    assert got["cases"] == {
        "float_indices": [False, False],
        "more_indices": [False],
        "not_consecutive": [False, False],
        "key_twice": [False, False],
        "get_more_indices": [False],
        "good": [True, True],
    }
    for says in (
        "not integers",
        "host indices for 1 pages",
        "not consecutive",
        "a key named twice",
    ):
        assert says in got["log"], says
    assert got["after"] == {"exists": 0, "set": [False], "get": [False]}
    assert got["after_s"] < 30
    assert not page_files(tmp_path)[2:], "only the good call's two pages were stored"


def test_a_mistyped_extra_config_key_is_an_error_naming_it(tmp_path: Path) -> None:
    """SGLang's storage extra_config with "confg" for "config": one error naming it (the
    backend used to open the embedded default store: 4 GiB of memory, 64 GiB of disk in
    SGLang's working folder)."""
    got = sglang(
        {"op": "construct", "model": model(tmp_path / "m", 1), "extra": {"confg": "x.yaml"}}
    )
    assert "unknown key 'confg'" in got["error"] and "did you mean 'config'" in got["error"]
