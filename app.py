"""Serve the default model (or --model) with the OpenAI API under /v1 and the chat UI at /.

    python app.py [--model smollm2] [--port 8000] [--host 127.0.0.1] [--share]
                  [--devices auto] [--max-batch 16] [--api-key KEY] [--limit NAME=VALUE]
                  [--ssl-certfile CERT --ssl-keyfile KEY] ...   (python app.py --help)
"""

from __future__ import annotations

import argparse
import sys

from nbserve.serving.cli import add_serve_options, serve_kwargs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2",
                        help='"smollm2" (default), a HF checkpoint directory or a .gguf file')
    add_serve_options(parser)
    args = parser.parse_args()
    import nbserve

    try:
        nbserve.serve(args.model, **serve_kwargs(args))
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"nbserve: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
