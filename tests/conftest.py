"""Shared fixtures: tiny random models in the Hugging Face layout, and a tiny tokenizer.

Everything runs offline: hub, telemetry and analytics are switched off before any import.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

sys.path.insert(0, str(Path(__file__).parent))  # `import tiny_models` from any test

import pytest
from server_util import app_running, engine_running
from tiny_models import make_byte_fallback_tokenizer, make_tiny_hf_dir, make_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random tiny LlamaForCausalLM (tied embeddings), SmolLM2-style ChatML template."""
    return make_tiny_hf_dir(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random tiny Qwen2ForCausalLM (q/k/v bias, untied lm_head)."""
    return make_tiny_hf_dir(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2",
                            tie=False)


@pytest.fixture(scope="session")
def tiny_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (untied) saved in ~100 KB shards with model.safetensors.index.json."""
    return make_tiny_hf_dir(tmp_path_factory.mktemp("models") / "tiny-sharded", arch="llama",
                            tie=False, max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """nbserve Tokenizer over the tiny byte-level BPE (<|im_end|> = 2 ends a reply)."""
    from nbserve.text import Tokenizer

    return Tokenizer(make_tiny_tokenizer(), bos_token_id=None, eos_token_ids=[2])


@pytest.fixture(scope="session")
def byte_fallback_tokenizer():
    """nbserve Tokenizer over a sentencepiece-style BPE with <0xAB> byte-fallback pieces."""
    from nbserve.text import Tokenizer

    return Tokenizer(make_byte_fallback_tokenizer(), bos_token_id=1, eos_token_ids=[2],
                     add_bos_token=True)


# The real default model, loaded once for the whole run (about 9 s a load): modules that serve
# it make their own engines over this one LoadedModel (engines keep their KV caches apart and
# only read the weights), one engine at a time.
@pytest.fixture(scope="session")
def default_loaded() -> Any:
    from nbserve.loading import load

    return load("smollm2", verbose=False)


# transformers' own reading of the default GGUF (float32) and of its tokenizer, the reference
# for several modules: read together with the file parsed once (gguf_parse_once: transformers
# parses it for the tokenizer, the config and the weights), once a run.
@pytest.fixture(scope="session")
def transformers_reference() -> tuple[Any, Any]:
    """(tokenizer, float32 model), both transformers' own from the default GGUF."""
    import torch
    from gguf_parse_once import parsed_once
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbserve.loading.default import default_model_path

    path = default_model_path()
    with parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    return tokenizer, model


@pytest.fixture(scope="session")
def reference_model(transformers_reference: tuple[Any, Any]) -> Any:
    return transformers_reference[1]


@pytest.fixture(scope="session")
def reference_tokenizer(transformers_reference: tuple[Any, Any]) -> Any:
    return transformers_reference[0]


# The tiny engine behind a real uvicorn server, once per test module that asks for them.
@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path) -> Iterator[Any]:
    with engine_running(tiny_llama_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def server_url(tiny_engine: Any) -> Iterator[str]:
    with app_running(tiny_engine) as url:
        yield url


@pytest.fixture
def no_server_left() -> Iterator[None]:
    """Fails a test that leaves a launched server running (and stops it): for test modules
    that launch servers, as `pytestmark = pytest.mark.usefixtures("no_server_left")`."""
    from nbserve.serving.launch import running_servers

    yield
    leftover = running_servers()
    for srv in leftover:
        srv.stop()
    assert not leftover, f"a test left servers running: {leftover}"
