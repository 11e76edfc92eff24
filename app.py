"""Serve the default model (or --model) with the OpenAI API under /v1 and the chat UI at /.

    python app.py [--model smollm2] [--port 8000] [--host 127.0.0.1] [--share]
                  [--devices auto] [--max-batch 16] [--api-key KEY] [--limit NAME=VALUE]
                  [--ssl-certfile CERT --ssl-keyfile KEY] ...   (python app.py --help)
"""

from __future__ import annotations

import argparse
import sys

from nbserve.serving.cli import add_serve_options, models_argument, serve_kwargs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None,
                        help='"smollm2" (default), a HF checkpoint directory, a .gguf file or '
                        'a folder of them; repeat it (each may be name=source) to serve several: '
                        'the first is the default, the others load on their first request')
    add_serve_options(parser)
    args = parser.parse_args()
    import nbserve

    try:
        nbserve.serve(models_argument(args.model or ["smollm2"]), **serve_kwargs(args))
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"nbserve: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
