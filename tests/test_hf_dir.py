"""Loading Hugging Face model directories: weights, tokenizer, template, stop ids and errors."""

from __future__ import annotations

import inspect
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import SMOLLM2_TEMPLATE, make_tiny_hf_dir

from nbserve.loading.hf_dir import find_weight_files, iter_safetensors, load_hf_dir, model_name
from nbserve.models.dtypes import resolve_dtype
from nbserve.text import ChatTemplate
from nbserve.text.chat_template import load_chat_template
from nbserve.text.files import MissingFileError
from nbserve.text.tokenizer import load_tokenizer

PROMPT = [{"role": "user", "content": "Hello 🎉"}]


def _copy(src: Path, tmp_path: Path, name: str = "model") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ----------------------------------------------------------------------------- happy paths


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_sharded_dir"])
def test_load_matches_transformers(fixture, request):
    transformers = pytest.importorskip("transformers")
    root = request.getfixturevalue(fixture)
    loaded = load_hf_dir(root)
    assert loaded.name == root.name and loaded.source == str(root.resolve())
    assert loaded.stop_token_ids == [2] and loaded.tokenizer.eos_token_ids == [2]
    assert loaded.model.dtype == torch.float32 and loaded.model.device.type == "cpu"

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(root))
    text = loaded.template.render(PROMPT)
    assert text == hf_tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = loaded.tokenizer.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)

    seq = torch.tensor([ids])
    cache = loaded.model.make_cache(1, len(ids))
    ours = loaded.model.forward(seq, torch.arange(len(ids))[None], torch.tensor([0]), cache)
    with torch.no_grad():
        ref = hf(seq).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_tokenizer_and_template_from_dir(tiny_llama_dir):
    tok, cfg = load_tokenizer(tiny_llama_dir)
    assert tok.bos_token_id == 1 and not tok.add_bos_token and tok.eos_token_ids == [2]
    assert cfg["eos_token"] == "<|im_end|>"
    template = load_chat_template(tiny_llama_dir, cfg)
    assert template.source == SMOLLM2_TEMPLATE and not template.is_default
    assert template.render(PROMPT).startswith("<|im_start|>system\nYou are a helpful AI")


def test_sharded_weights_equal_single_file(tiny_sharded_dir, tmp_path):
    files = find_weight_files(tiny_sharded_dir)
    assert len(files) > 1 and all(f.suffix == ".safetensors" for f in files)
    index = json.loads((tiny_sharded_dir / "model.safetensors.index.json").read_text())
    stream = iter_safetensors(files)
    assert inspect.isgenerator(stream)  # tensors arrive one at a time, not as one dict
    sharded = dict(stream)
    assert set(sharded) == set(index["weight_map"]) and "lm_head.weight" in sharded

    single_dir = make_tiny_hf_dir(tmp_path / "single", arch="llama", tie=False)
    single = load_file(single_dir / "model.safetensors")
    assert set(single) == set(sharded)
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]), name


def test_rotary_inv_freq_buffers_are_skipped(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"model.norm.weight": torch.ones(4),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}, str(path))
    assert [name for name, _ in iter_safetensors([path])] == ["model.norm.weight"]


def test_stop_ids_are_the_union_of_all_sources(tiny_llama_dir, tmp_path):
    root = _copy(tiny_llama_dir, tmp_path)
    _edit_json(root / "generation_config.json", eos_token_id=[2, 0])
    _edit_json(root / "config.json", eos_token_id=5)
    _edit_json(root / "tokenizer_config.json", eos_token="<|endoftext|>")
    tok, _ = load_tokenizer(root)
    assert tok.eos_token_ids == [2, 0, 5]
    assert {0, 2, 5} <= tok.special_ids


def test_chat_template_sources(tiny_llama_dir, tmp_path):
    root = _copy(tiny_llama_dir, tmp_path)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "T{{ tools | length }}"}]
    template = load_chat_template(root, cfg)
    assert template.render(PROMPT) == "DHello 🎉"
    assert template.render(PROMPT, tools=[{"type": "function"}]) == "T1"

    (root / "chat_template.jinja").write_text("J{{ bos_token }}{{ unk_token }}")
    assert load_chat_template(root, cfg).render(PROMPT) == "J<|im_start|><|endoftext|>"

    (root / "chat_template.jinja").unlink()
    del cfg["chat_template"]
    assert load_chat_template(root, cfg) is None


def test_model_name_and_dtype():
    assert model_name("/x/models--HuggingFaceTB--SmolLM2-135M/snapshots/abc123") == \
        "HuggingFaceTB/SmolLM2-135M"
    assert model_name("/x/my-model/") == "my-model"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, cpu) == torch.float32 == resolve_dtype("auto", cpu)
    assert resolve_dtype(None, cuda) in (torch.bfloat16, torch.float16)
    assert resolve_dtype("bf16", cpu) == torch.bfloat16 == resolve_dtype(torch.bfloat16, cpu)
    assert resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="one of auto, float32, bfloat16, float16 .the weight "
                                         "format is `weights`"):
        resolve_dtype(torch.int8, cpu)


def test_dtype_is_applied(tiny_llama_dir):
    loaded = load_hf_dir(tiny_llama_dir, dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- errors


def test_missing_config(tiny_llama_dir, tmp_path):
    root = _copy(tiny_llama_dir, tmp_path)
    (root / "config.json").unlink()
    with pytest.raises(MissingFileError, match=r"model has no config\.json") as err:
        load_hf_dir(root)
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ValueError)
    assert str(root) in str(err.value)


def test_missing_weights(tiny_llama_dir, tmp_path):
    root = _copy(tiny_llama_dir, tmp_path)
    (root / "model.safetensors").unlink()
    with pytest.raises(MissingFileError,
                       match=r"no model\.safetensors or model\.safetensors\.index"):
        load_hf_dir(root)


def test_missing_shard(tiny_sharded_dir, tmp_path):
    root = _copy(tiny_sharded_dir, tmp_path)
    shards = sorted(set(json.loads((root / "model.safetensors.index.json").read_text())
                        ["weight_map"].values()))
    (root / shards[1]).unlink()
    with pytest.raises(MissingFileError, match=f"missing 1 of {len(shards)}.*{shards[1]}"):
        load_hf_dir(root)


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_pickle_checkpoints_are_refused_never_loaded(tiny_llama_dir, tmp_path, monkeypatch):
    root = _copy(tiny_llama_dir, tmp_path)
    (root / "model.safetensors").unlink()
    (root / "pytorch_model.bin").write_bytes(pickle.dumps(_Exploit()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors only.*save_pretrained"):
        load_hf_dir(root)
    assert not (tmp_path / "pwned").exists()


def test_unsupported_architecture(tiny_llama_dir, tmp_path):
    root = _copy(tiny_llama_dir, tmp_path)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["BloomForCausalLM"], "model_type": "bloom", "n_embd": 64, "n_layer": 2}))
    with pytest.raises(ValueError, match="BloomForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_hf_dir(root)


def test_a_native_family_config_missing_a_key_names_it(tiny_llama_dir, tmp_path):
    root = _copy(tiny_llama_dir, tmp_path)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    with pytest.raises(ValueError, match="lacks 'n_head'.*GPT-2"):
        load_hf_dir(root)


def test_missing_tokenizer(tiny_llama_dir, tmp_path):
    root = _copy(tiny_llama_dir, tmp_path)
    (root / "tokenizer.json").unlink()
    with pytest.raises(MissingFileError, match=r"no tokenizer\.json"):
        load_hf_dir(root)
    (root / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(MissingFileError, match="sentencepiece.*save_pretrained"):
        load_hf_dir(root)


def test_bad_paths_and_json(tiny_llama_dir, tmp_path):
    with pytest.raises(MissingFileError, match="no model directory"):
        load_hf_dir(tmp_path / "nope")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_hf_dir(tmp_path / "file.txt")
    root = _copy(tiny_llama_dir, tmp_path)
    (root / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_hf_dir(root)


def test_broken_template_names_the_model(tiny_llama_dir, tmp_path):
    root = _copy(tiny_llama_dir, tmp_path, "broken-model")
    _edit_json(root / "tokenizer_config.json", chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="broken-model.*syntax error"):
        load_hf_dir(root)


def test_default_template_is_separate():
    assert ChatTemplate.default().is_default
