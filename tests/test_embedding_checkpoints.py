"""Embedding checkpoints load with the pooling they declare (issue 43, point 3): a tiny random
Qwen3 saved by transformers as a bare `Qwen3Model` (Qwen3-Embedding's layout: no `model.`
prefix, no LM head) with sentence-transformers' files written by hand; a GGUF's
`<arch>.pooling_type`; the pooling nbserve cannot do refused at load; a headless model's
generation requests refused with a 400 that says it is an embedding model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers
from embed_models import save_qwen3, write_st_config
from gguf_util import hf_dir_to_gguf
from server_util import app_running, engine_running

from nbserve.loading import load
from nbserve.loading.hf_dir import load_hf_dir
from nbserve.models.pooling import DECODER_DEFAULT, Pooling
from nbserve.types import EmbedSpec, InvalidRequestError, Request


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-Embedding's layout: `Qwen3Model`, last-token pooling, normalised."""
    path = save_qwen3(tmp_path_factory.mktemp("qwen3-embedding"), bare=True)
    write_st_config(path, {"lasttoken": True})
    return path


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_bare_qwen3_model_loads_headless_with_its_declared_pooling(bare_dir: Path) -> None:
    names = json.loads((bare_dir / "config.json").read_text())["architectures"]
    assert names == ["Qwen3Model"]  # what transformers saves for the backbone alone
    loaded = load_hf_dir(bare_dir)
    assert loaded.pooling == Pooling(kind="last", normalize=True)
    assert not loaded.model.has_lm_head
    # the whole backbone loaded: its final hidden states (through the head slot, which holds
    # the embedding) equal transformers' Qwen3Model's
    hf = transformers.Qwen3Model.from_pretrained(bare_dir, attn_implementation="eager").eval()
    ids = torch.tensor([[5, 17, 99, 123, 7, 300, 42, 11]])
    with torch.no_grad():
        want = hf(ids).last_hidden_state[0] @ hf.embed_tokens.weight.T
    model = loaded.model
    cache = model.make_paged_cache(4, 8)
    got = model.forward(ids, torch.arange(ids.shape[1])[None], torch.arange(4)[None], cache)
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)


def test_flat_names_under_a_causal_name_without_a_head_are_headless(
        bare_dir: Path, tmp_path: Path) -> None:
    """Qwen3-Embedding-8B: config says Qwen3ForCausalLM, untied, yet no lm_head is stored."""
    path = _copy_dir(bare_dir, tmp_path / "flat")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "modules.json").unlink()
    loaded = load_hf_dir(path)
    assert not loaded.model.has_lm_head and loaded.pooling == DECODER_DEFAULT


@pytest.mark.parametrize(("modes", "normalize", "want"), [
    ({"mean_tokens": True}, False, Pooling("mean", False)),
    ({"cls_token": True}, True, Pooling("cls", True)),
    ({"lasttoken": True}, False, Pooling("last", False)),
])
def test_sentence_transformers_pooling_is_read(tmp_path: Path, bare_dir: Path,
                                               modes: dict[str, bool], normalize: bool,
                                               want: Pooling) -> None:
    path = _copy_dir(bare_dir, tmp_path / "st")
    write_st_config(path, modes, normalize=normalize)
    assert load_hf_dir(path).pooling == want


def test_the_newer_single_pooling_mode_key_is_read(tmp_path: Path, bare_dir: Path) -> None:
    path = _copy_dir(bare_dir, tmp_path / "st")
    write_st_config(path, {}, pooling_mode="mean")
    assert load_hf_dir(path).pooling == Pooling("mean", True)


DENSE = {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}


@pytest.mark.parametrize(("modes", "extra", "keys", "said"), [
    ({"max_tokens": True}, None, {}, "pooling_mode_max_tokens"),
    ({"weightedmean_tokens": True}, None, {}, "pooling_mode_weightedmean_tokens"),
    ({"mean_tokens": True, "cls_token": True}, None, {}, "2 pooling modes"),
    ({}, None, {}, "0 pooling modes"),
    ({"lasttoken": True}, [DENSE], {}, "sentence_transformers.models.Dense"),
    ({"mean_tokens": True}, None, {"include_prompt": False}, "include_prompt"),
])
def test_pooling_nbserve_cannot_do_is_refused_at_load(
        tmp_path: Path, bare_dir: Path, modes: dict[str, bool],
        extra: list[dict[str, Any]] | None, keys: dict[str, Any], said: str) -> None:
    path = _copy_dir(bare_dir, tmp_path / "st")
    write_st_config(path, modes, extra_modules=extra, **keys)
    with pytest.raises(ValueError, match=said):
        load_hf_dir(path)


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied Qwen3ForCausalLM (its GGUF has no output.weight)."""
    return save_qwen3(tmp_path_factory.mktemp("qwen3-causal"), tie=True)


def test_a_causal_checkpoint_declares_nothing_and_generates(causal_dir: Path) -> None:
    loaded = load_hf_dir(causal_dir)
    assert loaded.pooling == DECODER_DEFAULT and loaded.model.has_lm_head


@pytest.mark.parametrize(("pooling_type", "want", "headless"), [
    (None, DECODER_DEFAULT, False), (0, DECODER_DEFAULT, False),
    (1, Pooling("mean", True), True), (2, Pooling("cls", True), True),
    (3, Pooling("last", True), True)])
def test_gguf_pooling_type_is_read(tmp_path: Path, causal_dir: Path, pooling_type: int | None,
                                   want: Pooling, headless: bool) -> None:
    meta = {} if pooling_type is None else {"qwen3.pooling_type": pooling_type}
    path = hf_dir_to_gguf(causal_dir, tmp_path / "m.gguf", metadata=meta)
    loaded = load(str(path), device="cpu", weights="dense", verbose=False)
    assert loaded.pooling == want
    assert loaded.model.has_lm_head is not headless  # an embedding model without output.weight


def test_gguf_rank_pooling_is_refused(tmp_path: Path, causal_dir: Path) -> None:
    path = hf_dir_to_gguf(causal_dir, tmp_path / "m.gguf", metadata={"qwen3.pooling_type": 4})
    with pytest.raises(ValueError, match="rank"):
        load(str(path), device="cpu", weights="dense", verbose=False)


def test_a_headless_model_refuses_generation_with_a_clear_400(bare_dir: Path) -> None:
    with engine_running(bare_dir) as engine:
        with pytest.raises(InvalidRequestError, match="embedding model"):
            engine.submit(Request(prompt="hello"), lambda ev: None)
        with app_running(engine) as url:
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 400, r.text
            assert "embedding model" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- served vectors

IDS = [[5, 17, 99, 123, 7, 300, 42, 11], [64, 3, 250, 9, 18], [400]]


def _reference(path: Path, pooling: Pooling) -> list[list[float]]:
    """transformers' Qwen3Model final hidden states of IDS, pooled as `pooling` says."""
    hf = transformers.Qwen3Model.from_pretrained(path, attn_implementation="eager").eval()
    out = []
    for ids in IDS:
        with torch.no_grad():
            h = hf(torch.tensor([ids])).last_hidden_state[0]
        v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling.kind]
        out.append((torch.nn.functional.normalize(v, dim=0) if pooling.normalize else v).tolist())
    return out


@pytest.mark.parametrize(("modes", "normalize", "want"), [
    ({"lasttoken": True}, True, Pooling("last", True)),
    ({"mean_tokens": True}, False, Pooling("mean", False)),
    ({"cls_token": True}, True, Pooling("cls", True))])
def test_served_embeddings_are_pooled_as_the_checkpoint_declares(
        tmp_path: Path, bare_dir: Path, modes: dict[str, bool], normalize: bool,
        want: Pooling) -> None:
    """Through /v1/embeddings on a real port: transformers' hidden states pooled the declared
    way, to 1e-4. Skips until the engine serves embedding requests (the embed branch)."""
    path = _copy_dir(bare_dir, tmp_path / "st")
    write_st_config(path, modes, normalize=normalize)
    with engine_running(path) as engine:
        try:
            engine.submit(Request(prompt_ids=[5, 6], embed=EmbedSpec()), lambda ev: None)
        except InvalidRequestError as exc:
            if "not served by this engine yet" in str(exc):
                pytest.skip("waits for the engine side of issue 43 (prefill-only requests)")
            raise
        with app_running(engine) as url:
            r = httpx.post(url + "/v1/embeddings", json={"input": IDS}, timeout=60)
    assert r.status_code == 200, r.text
    got = [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    ref = _reference(path, want)
    for g, w in zip(got, ref, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=0)
