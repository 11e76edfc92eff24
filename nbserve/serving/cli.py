"""The `nbserve` command line: `nbserve serve MODEL [options]` runs the server until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .options import add_cli_options, cli_kwargs


def parse_devices(value: str | None) -> Any:
    """"auto", a count ("2"), or a comma-separated list ("cuda:0,cuda:1"; "cpu,cpu")."""
    if value is None or value == "auto":
        return value
    if value.isdigit():
        return int(value)
    parts = [p.strip() for p in value.split(",") if p.strip()]
    return parts[0] if len(parts) == 1 else parts


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """The options `nbserve serve` and `python app.py` share."""
    parser.add_argument("--port", type=int, default=8000, help="port (0: pick a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 to accept other machines)")
    parser.add_argument("--share", action="store_true",
                        help="also open a public Gradio share link (UI and /v1)")
    parser.add_argument("--devices", default=None,
                        help='"auto", a count, or a list like "cuda:0,cuda:1" (one replica each)')
    parser.add_argument("--max-batch", type=int, default=None, help="sequences decoded together")
    parser.add_argument("--max-context", type=int, default=None,
                        help="tokens per sequence (default: min(model's, 4096))")
    parser.add_argument("--dtype", default=None,
                        choices=["float32", "bfloat16", "float16", "mixed16", "quantized"],
                        help="weights: float32 (CPU default; for a GGUF of Q4_0/Q4_1/Q8_0 "
                        "blocks, quantized, lossless there), bfloat16 (GPU default), float16, "
                        "mixed16 (CPU: float16 copies for one- and two-row steps, +50%% "
                        "memory), or quantized (CPU: a GGUF's own 4/8-bit blocks, or Q8_0 made "
                        "at load, for steps of up to 12 rows: about 2.5x float32's speed "
                        "alone; nbserve's C kernels build with the system's compiler)")
    add_cli_options(parser)  # the server options: one flag per ServerOptions field


def serve_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """launch() keywords from parsed `add_serve_options` flags."""
    kwargs: dict[str, Any] = {"port": args.port, "host": args.host, "share": args.share,
                              "devices": parse_devices(args.devices)}
    for name in ("max_batch", "max_context", "dtype"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    kwargs.update(cli_kwargs(args))
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbserve", description="Serve a language model: "
                                     "OpenAI-compatible API under /v1 and a chat UI at /.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model until Ctrl-C")
    serve.add_argument("model", nargs="?", default="smollm2",
                       help='"smollm2" (default), a HF checkpoint directory or a .gguf file')
    add_serve_options(serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .launch import serve

    try:
        serve(args.model, **serve_kwargs(args))
    except (OSError, ValueError, RuntimeError) as exc:  # a clear message, not a traceback
        print(f"nbserve: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
