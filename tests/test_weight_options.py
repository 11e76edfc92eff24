"""The weight format and the compute dtype are separate options (issue 42 item 3): `weights`
("auto", "blocks", "dense", "mixed16") and `exact` beside `dtype` (the compute dtype only),
through load(), the CLI and launch(); the old dtype names that carried a format still work,
with a FutureWarning naming the new spelling; bad values are refused with the valid ones."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
from gguf_util import hf_dir_to_gguf
from kernel_paths import NEEDS_COMPILER

import nbserve
from nbserve.execution.formats import BlockForm
from nbserve.models.dtypes import WeightChoice, load_kwargs, weight_choice, weights_of
from nbserve.serving.cli import build_parser, serve_kwargs

pytestmark = pytest.mark.usefixtures("no_server_left")


@pytest.fixture(scope="module")
def q8_gguf(tiny_llama_dir, tmp_path_factory):
    return hf_dir_to_gguf(tiny_llama_dir, tmp_path_factory.mktemp("w") / "m.gguf", "Q8_0")


@pytest.mark.parametrize(("old", "weights", "exact"), [
    ("quantized", "blocks", False), ("quantized-exact", "blocks", True),
    ("mixed16", "mixed16", False)])
def test_the_old_dtype_names_map_to_weights_and_warn(old, weights, exact):
    with pytest.warns(FutureWarning, match=f"weights='{weights}'"):
        assert weight_choice(old) == WeightChoice(None, weights, exact)
    with pytest.raises(ValueError, match="means weights="):  # two formats asked at once
        weight_choice(old, weights="dense")


@NEEDS_COMPILER
def test_an_old_dtype_name_through_load_warns_and_serves_the_same(q8_gguf):
    with pytest.warns(FutureWarning, match="weights='blocks', exact=True"):
        old = nbserve.load(str(q8_gguf), dtype="quantized-exact", verbose=False).model
    new = nbserve.load(str(q8_gguf), weights="blocks", exact=True, verbose=False).model
    assert old.weight_format == new.weight_format == "quantized-exact"


@pytest.mark.parametrize(("option", "value", "valid"), [
    ("weights", "q4", "auto, blocks, dense, mixed16"),
    ("dtype", "int8", "auto, float32, bfloat16, float16"),
    ("exact", "yes", "True or False")])
def test_bad_values_are_refused_with_the_valid_ones(tiny_llama_dir, option, value, valid):
    with pytest.raises(ValueError, match=valid):
        nbserve.load(str(tiny_llama_dir), verbose=False, **{option: value})


def test_exact_applies_to_blocks_only(tiny_llama_dir):
    for weights in ("dense", "mixed16"):  # no rounded kernels there: refused, not ignored
        with pytest.raises(ValueError, match="exact=True applies to weights='blocks'"):
            nbserve.load(str(tiny_llama_dir), weights=weights, exact=True, verbose=False)


@pytest.mark.parametrize("name", ["quantized", "quantized-exact", "mixed16", "float32"])
def test_load_kwargs_build_the_format_a_model_reports(name):
    options = load_kwargs(name)
    choice = weight_choice(**options)  # no FutureWarning: the new spelling
    assert choice.format == (None if name == "float32" else name)
    assert weights_of(name) == (choice.weights, choice.exact)


@NEEDS_COMPILER
def test_blocks_compute_in_float32_only(q8_gguf):
    with pytest.raises(ValueError, match="computes in float32"):
        nbserve.load(str(q8_gguf), weights="blocks", dtype="bfloat16", verbose=False)


@NEEDS_COMPILER
def test_each_weight_format_through_load(q8_gguf, tiny_llama_dir, capsys):
    auto = nbserve.load(str(q8_gguf)).model  # a quantized GGUF on CPU: its blocks
    assert auto.weight_format == "quantized"
    assert "blocks weights, float32" in capsys.readouterr().out  # the load line: both
    holders = list(auto._named_holders())
    assert holders and all(isinstance(h.form, BlockForm) for h, _ in holders)
    exact = nbserve.load(str(q8_gguf), exact=True).model
    assert exact.weight_format == "quantized-exact"
    assert "blocks exact weights, float32" in capsys.readouterr().out
    dense = nbserve.load(str(q8_gguf), weights="dense").model  # dequantized, float32
    assert dense.weight_format == "float32" and not dense.dense_released
    assert all(p.device.type == "cpu" for p in dense.parameters())
    assert "dense weights, float32" in capsys.readouterr().out
    half = nbserve.load(str(q8_gguf), weights="dense", dtype="bfloat16", verbose=False).model
    assert half.dtype == torch.bfloat16
    mixed = nbserve.load(str(q8_gguf), weights="mixed16", verbose=False).model
    assert mixed.weight_format == "mixed16"
    made = nbserve.load(str(tiny_llama_dir), weights="blocks", verbose=False).model
    assert made.weight_format == "quantized"  # Q8_0 made at load from float weights
    plain = nbserve.load(str(tiny_llama_dir), verbose=False).model  # auto: dense
    assert plain.weight_format == "float32"


@NEEDS_COMPILER
def test_the_cli_takes_weights_and_exact(q8_gguf):
    args = build_parser().parse_args(["serve", str(q8_gguf), "--weights", "blocks", "--exact",
                                      "--dtype", "float32"])
    kwargs = serve_kwargs(args)
    assert (kwargs["weights"], kwargs["exact"], kwargs["dtype"]) == ("blocks", True, "float32")
    assert "weights" not in serve_kwargs(build_parser().parse_args(["serve", str(q8_gguf)]))
    bad = subprocess.run([sys.executable, "-m", "nbserve", "serve", str(q8_gguf),
                          "--weights", "q4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    error = bad.stderr.splitlines()[-1]
    assert "--weights: invalid choice: 'q4'" in error, bad.stderr
    assert all(valid in error for valid in ("auto", "blocks", "dense", "mixed16")), error


@NEEDS_COMPILER
def test_launch_with_dense_weights_answers_over_http(q8_gguf):
    srv = nbserve.launch(str(q8_gguf), port=None, ui=False, weights="dense", max_batch=2,
                         max_context=128)
    try:
        srv.wait()
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "model": srv.engine.model_name, "prompt": "hello", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] is not None
        stats = httpx.get(f"{srv.url}/stats", timeout=30).json()
        assert (stats["weights"], stats["exact"], stats["dtype"]) == ("dense", False, "float32")
        blocks = srv.update()  # the same options again: still dense
        assert httpx.get(f"{blocks.url}/stats", timeout=30).json()["weights"] == "dense"
    finally:
        srv.stop()
