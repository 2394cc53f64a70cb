"""The ``hurray-store`` command line: the parser, ``serve`` and ``stats`` here; the
format tools in ``format_cmds``, the model jobs in ``model_cmds``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from hurray_store.cli.format_cmds import cmd_demo, cmd_inspect
from hurray_store.cli.model_cmds import cmd_replay, cmd_warmup
from hurray_store.errors import HurrayStoreError


def cmd_serve(args: argparse.Namespace) -> int:
    """The cache server on a config's tiers, until SIGTERM or SIGINT (then exit 0)."""
    import asyncio
    import logging

    from hurray_store.config import load_config
    from hurray_store.errors import ConfigError
    from hurray_store.server import serve, server_store

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = load_config(args.config)
        store = server_store(cfg)
    except ConfigError as e:
        print(f"hurray-store serve: error: {e}", file=sys.stderr)
        return 2
    metrics_port = (
        -1 if args.metrics_port is None else (None if args.metrics_port < 0 else args.metrics_port)
    )
    if args.port == 0 and args.metrics_port is None:  # a free port: its metrics' too
        metrics_port = 0
    try:
        asyncio.run(
            serve(store, cfg.server, host=args.host, port=args.port, metrics_port=metrics_port)
        )
    except OSError as e:  # the port is taken, the address is not ours
        print(f"hurray-store serve: error: cannot listen: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """A running server's stats (its store's tiers, connections, staged segments)."""
    import asyncio
    import json

    from hurray_store.config import RemoteTierConfig
    from hurray_store.tiers.remote import RemoteTier

    async def get() -> dict[str, Any] | None:
        t = RemoteTier(
            RemoteTierConfig(
                url=args.url, name="remote", token=args.token or "", backoff_initial_s=0.0
            )
        )
        try:
            return await t.server_stats()
        finally:
            await t.close()

    stats = asyncio.run(get())
    if stats is None:
        print(f"hurray-store stats: no answer from {args.url}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    """Print a publisher's KV events, one line an event (docs/events.md)."""
    from hurray_store.events.subscriber import Subscriber, watch

    sub = Subscriber(args.endpoint, args.topic, args.replay)
    try:
        if args.replay_from is not None:
            from hurray_store.events.subscriber import lines

            for r in sub.replay(args.replay_from):
                for line in lines(r):
                    print(line, flush=True)
                sub.last = r.seq
        watch(sub, lambda line: print(line, flush=True), count=args.count, timeout_s=args.idle)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
    return 0


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _port(text: str) -> int:
    """An argparse type: a TCP port (0 picks a free one; -1 for --metrics-port: none)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not -1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (0-65535), got {n}")
    return n


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, help="store config (YAML); default: the embedded default"
    )
    p.add_argument("--model", required=True, help="a model directory (save_pretrained)")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="default: the model's own",
    )
    p.add_argument(
        "--page-size",
        type=_positive,
        default=None,
        help="tokens per page (default 16; 32 for --engine vllm)",
    )
    p.add_argument(
        "--hf-overrides",
        default=None,
        help="JSON: config fields to override, as vLLM's --hf-overrides takes them (the "
        "cache is keyed by the config the model runs with: give the serving instances' own)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive,
        default=8,
        help="prompts prefilled at once (more: faster on a GPU, more memory)",
    )
    p.add_argument(
        "--strict", action="store_true", help="abort on a bad corpus line instead of skipping it"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``prog: error: ...``, exit code 2), not the
    usage text before it; ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a store config and print it resolved: every key with its default filled
    in, and what each tier will use. Exit 2 with the dotted key on an error."""
    import json
    from dataclasses import asdict

    from hurray_store.config import load_config

    cfg = load_config(args.file)
    print(json.dumps(asdict(cfg), indent=2, default=str))
    print(f"\n{args.file or '(the embedded default)'}: valid; tiers, fastest first:")
    for t in cfg.tiers:
        cap = getattr(t, "capacity_bytes", None)
        where = getattr(t, "path", "") or getattr(t, "url", "") or getattr(t, "bucket", "")
        budget = "no budget of ours" if cap is None else f"{cap / (1 << 20):,.0f} MiB"
        print(f"  {t.name or t.kind} ({t.kind}): {budget}{', ' + str(where) if where else ''}")
    return 0


def _version() -> str:
    from hurray_store import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hurray-store",
        description="KV-cache storage on Hurray block-paged descriptors. "
        "Run `hurray-store COMMAND --help` for a command's arguments and an example.",
    )
    p.add_argument("--version", action="version", version=f"hurray-store {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cc = sub.add_parser(
        "check-config",
        help="validate a store config and print it resolved, with every default",
        description="Validate a store config (YAML) and print it resolved: every key with "
        "its default, and what each tier will use. Exit 2 naming the dotted key of the "
        "first error. Example: hurray-store check-config configs/server.yaml",
    )
    cc.add_argument(
        "file", nargs="?", default=None, help="the config's path (default: the embedded one)"
    )
    cc.set_defaults(func=cmd_check_config)
    w = sub.add_parser(
        "warmup",
        help="prefill a prompt corpus with a model and fill the cache",
        description="Prefill a prompt corpus with a model and store its KV. Example: "
        "hurray-store warmup --model .hurray-cache/tiny-model --prompts "
        "configs/sample_prompts.jsonl --config configs/default.yaml",
    )
    _model_args(w)
    w.add_argument(
        "--prompts", required=True, help='JSONL: {"text": ...} or {"token_ids": [...]} per line'
    )
    w.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="what computes the KV: transformers (the default: no vLLM needed; the cache "
        "it fills serves prefill_with_cache and replay), or vLLM through HurrayConnector "
        "(the cache vLLM serving reads; run from the vLLM environment; --page-size is "
        "vLLM's block size, a multiple of 32 on the CPU)",
    )
    w.set_defaults(func=cmd_warmup)
    r = sub.add_parser(
        "replay",
        help="replay requests against the cache: hit rate and time to first token",
        description="Replay requests against the cache: hit rate and time to first token. "
        "Example: hurray-store replay --model .hurray-cache/tiny-model --prompts "
        "configs/sample_replay.jsonl --warmup-prompts configs/sample_prompts.jsonl",
    )
    _model_args(r)
    r.add_argument("--prompts", required=True, help="JSONL requests to replay")
    r.add_argument(
        "--warmup-prompts", default=None, help="JSONL corpus to warm the cache with first"
    )
    r.set_defaults(func=cmd_replay)
    d = sub.add_parser(
        "codec-demo",
        help="encode, decode and check a synthetic batch with shared prefixes",
        description="Encode, decode and check a synthetic batch with shared prefixes. "
        "Example: hurray-store codec-demo --layers 2 --tokens 256",
    )
    d.add_argument("--layers", type=_positive, default=4, help="layers of the batch")
    d.add_argument("--seqs", type=_positive, default=16, help="sequences of the batch")
    d.add_argument("--tokens", type=_positive, default=2048, help="tokens per sequence")
    d.add_argument("--heads", type=_positive, default=8, help="KV heads")
    d.add_argument("--dim", type=_positive, default=128, help="head size")
    d.add_argument("--page-size", type=_positive, default=16, help="tokens per page")
    d.set_defaults(func=cmd_demo)
    sv = sub.add_parser(
        "serve",
        help="run the cache server (Hurray network transport) on a config's tiers",
        description="Run the cache server on a config's tiers until SIGTERM or SIGINT. "
        "Example: hurray-store serve --config configs/server.yaml",
    )
    sv.add_argument(
        "--config",
        default=None,
        help="store config with a server: section (default: the embedded default)",
    )
    sv.add_argument("--host", default=None, help="address to listen on (default: server.host)")
    sv.add_argument(
        "--port",
        type=_port,
        default=None,
        help="port (default: server.port; 0 picks a free one, and a free metrics port "
        "unless --metrics-port says otherwise)",
    )
    sv.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="HTTP port for /metrics and health (default: server.metrics_port; -1: none)",
    )
    sv.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="what the server logs (default: info)",
    )
    sv.set_defaults(func=cmd_serve)
    st = sub.add_parser(
        "stats",
        help="print a running cache server's stats as JSON",
        description="Print a running cache server's stats as JSON. "
        "Example: hurray-store stats --url hurray://127.0.0.1:9470",
    )
    st.add_argument(
        "--url", default="hurray://127.0.0.1:9470", help="the server (default: this machine's)"
    )
    st.add_argument("--token", default=None, help="the server's token, if it asks for one")
    st.set_defaults(func=cmd_stats)
    ev = sub.add_parser(
        "events",
        help="print the KV events a store or cache server publishes, one line an event",
        description="Subscribe to a publisher's KV events (vLLM's wire format over ZMQ) "
        "and print them. Example: hurray-store events --endpoint tcp://127.0.0.1:5557",
    )
    ev.add_argument("--endpoint", required=True, help="the publisher's events.endpoint")
    ev.add_argument(
        "--topic", default="", help="only topics starting with this (default: every topic)"
    )
    ev.add_argument(
        "--replay",
        default="",
        help="the publisher's events.replay_endpoint: missed batches are asked for again",
    )
    ev.add_argument(
        "--replay-from",
        type=int,
        default=None,
        metavar="SEQ",
        help="first print the kept batches from this sequence number (needs --replay)",
    )
    ev.add_argument("--count", type=int, default=0, help="stop after this many events")
    ev.add_argument(
        "--idle", type=float, default=0.0, help="stop after this many seconds with no event"
    )
    ev.set_defaults(func=cmd_events)
    i = sub.add_parser(
        "inspect",
        help="print every descriptor field of a layer object or a manifest",
        description="Print every descriptor field of a stored layer object or manifest. "
        "Example: hurray-store inspect \"$(find .hurray-cache -path '*objects*' -type f "
        '| head -1)"',
    )
    i.add_argument(
        "path",
        help="a stored object's file (a disk tier's objects/ folder: its names are the "
        "objects' keys, URL-encoded), or any file holding one",
    )
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command. Bad input (a config, a file, a URL, a value) is one line on stderr
    and exit code 2, never a traceback. A bare call prints the usage (exit 2)."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else list(argv)):
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument (its one line is printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.func(args))
    except (HurrayStoreError, OSError, ValueError, RecursionError) as e:
        what = str(e) or type(e).__name__
        print(f"hurray-store {args.command}: error: {what}", file=sys.stderr)
        return 2
