"""The `nbserve` command line: `nbserve serve MODEL [options]` runs the server until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ..models.dtypes import COMPUTE_DTYPES, FORMAT_ALIASES, WEIGHTS
from .options import add_cli_options, cli_kwargs


def parse_devices(value: str | None) -> str | int | list[str] | None:
    """"auto", a count ("2"), or a comma-separated list ("cuda:0,cuda:1"; "cpu,cpu")."""
    if value is None or value == "auto":
        return value
    if value.isdigit():
        return int(value)
    parts = [p.strip() for p in value.split(",") if p.strip()]
    return parts[0] if len(parts) == 1 else parts


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_kv_memory(text: str) -> int | float:
    """`--kv-memory`: "2GiB", "512MiB", "1500000" (bytes) or "0.3" (a fraction in (0, 1])."""
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("kmgib")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0 or (not unit and "." in number and value > 1):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a KV budget: give bytes (\"2GiB\", \"512MiB\", \"1000000\") or "
            "a fraction of the free memory in (0, 1] (\"0.3\")")
    if not unit and "." in number:
        return value
    return int(value * _UNITS[unit])


def positive_int(text: str) -> int:
    """An integer >= 1 (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def seconds(text: str) -> float:
    """A number of seconds >= 0 (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """The options `nbserve serve` and `python app.py` share."""
    parser.add_argument("--port", type=int, default=8000, help="port (0: pick a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 to accept other machines)")
    parser.add_argument("--share", action="store_true",
                        help="also open a public Gradio share link (UI and /v1)")
    parser.add_argument("--devices", default=None,
                        help='"auto", a count, or a list like "cuda:0,cuda:1" (one replica each)')
    parser.add_argument("--max-batch", type=int, default=None,
                        help="sequences running together (default 64; a limit, no reservation)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="tokens per sequence (default: the model's, within the KV budget)")
    parser.add_argument("--kv-memory", type=parse_kv_memory, default=None,
                        help='KV cache budget: bytes ("2GiB", "512MiB", "1000000") or a '
                        'fraction of the free memory / available RAM ("0.3"); default 0.25 of '
                        "the RAM on CPU (within a cgroup's limit), 0.9 of the GPU's free "
                        "memory, at most max-batch sequences of max-context; committed as used "
                        "on CPU")
    parser.add_argument("--kv-block-size", type=int, default=None, help="tokens per KV block "
                        "(default 16; full blocks are shared between requests by prefix)")
    parser.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="the KV cache's dtype (default: float16 for a quantized CPU model, "
                        "else the model's dtype; float16 halves it)")
    parser.add_argument("--dtype", default=None,
                        choices=[*COMPUTE_DTYPES, *FORMAT_ALIASES],
                        help="the compute dtype: auto (float32 on CPU, bfloat16 on a GPU), "
                        "float32, bfloat16 or float16 (the weight format is --weights; the "
                        "old names mixed16, quantized and quantized-exact still work, with a "
                        "warning)")
    parser.add_argument("--weights", default=None, choices=WEIGHTS,
                        help="the weight format: auto (default: without --dtype, a quantized "
                        "GGUF on CPU is served from its own blocks, never dequantized; "
                        "anything else dense in --dtype), blocks (CPU: every step over "
                        "quantized blocks, a GGUF's own or Q8_0 made at load: about the file's "
                        "size in memory; nbserve's "
                        "C kernels build with the system's compiler), dense (dequantized to "
                        "--dtype) or mixed16 (CPU: float32 plus float16 copies for one- and "
                        "two-row steps, +50%% memory)")
    parser.add_argument("--exact", action="store_true", default=None,
                        help="blocks: float32 arithmetic on every kernel path (by default, "
                        "steps of a few rows round their inputs to 16 bits per block where "
                        "that measures faster)")
    parser.add_argument("--max-backlog", type=positive_int, default=None, metavar="N",
                        help="events per choice a streaming client may leave unread (default "
                        "1024); see --slow-client-timeout")
    parser.add_argument("--slow-client-timeout", type=seconds, default=None, metavar="S",
                        help="a client over --max-backlog whose oldest unread event has waited "
                        "longer than S seconds is too slow: its request is cancelled, its "
                        "stream ends with client_too_slow (default 10; 0: the count alone)")
    parser.add_argument("--max-loaded", type=positive_int, default=None, metavar="N",
                        help="several models: at most N loaded at once, the default included "
                        "(the least recently used other one is unloaded)")
    parser.add_argument("--max-memory", type=parse_kv_memory, default=None, metavar="BYTES",
                        help='several models: unload the least recently used other ones past '
                        'this many bytes of weights and KV cache ("8GiB")')
    parser.add_argument("--keep-alive", type=seconds, default=None, metavar="S",
                        help="several models: unload another model idle for S seconds")
    parser.add_argument("--lora", action="append", type=lora_argument, default=None,
                        metavar="NAME=PATH",
                        help="serve the LoRA adapter at PATH (a PEFT directory or a GGUF LoRA "
                        "file) as model:NAME of the default model, or of model BASE with "
                        "BASE:NAME=PATH; repeat for several")
    add_cli_options(parser)  # the server options: one flag per ServerOptions field


def lora_argument(text: str) -> tuple[str, str]:
    """("name" or "base:name", path) of a --lora value."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: write NAME=PATH (or BASE:NAME=PATH)")
    return name.strip(), path.strip()


def serve_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """launch() keywords from parsed `add_serve_options` flags."""
    kwargs: dict[str, Any] = {"port": args.port, "host": args.host, "share": args.share,
                              "devices": parse_devices(args.devices)}
    for name in ("max_batch", "max_context", "dtype", "weights", "exact", "kv_memory",
                 "kv_block_size", "kv_dtype",
                 "max_backlog", "slow_client_timeout", "max_loaded", "max_memory",
                 "keep_alive"):
        value = vars(args).get(name)  # (the flags of add_serve_options; None: not given)
        if value is not None:
            kwargs[name] = value
    if vars(args).get("lora"):
        kwargs["adapters"] = dict(args.lora)
    kwargs.update(cli_kwargs(args))
    return kwargs


def models_argument(given: Sequence[str] | str) -> str | list[str]:
    """What `launch` takes of the model arguments: one source as it is, several as a list."""
    if isinstance(given, str):
        return given
    return given[0] if len(given) == 1 else list(given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbserve", description="Serve a language model: "
                                     "OpenAI-compatible API under /v1 and a chat UI at /.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model until Ctrl-C")
    serve.add_argument("model", nargs="*", default=["smollm2"],
                       help='"smollm2" (default), a HF checkpoint directory, a .gguf file, or '
                       'a folder of them; several (each may be name=source): the first is the '
                       'default, the others load on the first request that names them')
    add_serve_options(serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .launch import serve

    try:
        serve(models_argument(args.model), **serve_kwargs(args))
    except (OSError, ValueError, RuntimeError) as exc:  # a clear message, not a traceback
        print(f"nbserve: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
