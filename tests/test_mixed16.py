"""weights="mixed16": float16 copies of the matmul weights for one- and two-row steps."""

from __future__ import annotations

import pytest
import torch

import nbserve
from nbserve.execution.linear import FLOAT16_MAX_ROWS, HalfCopy
from nbserve.execution.weights import count_parameters


def _steps(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits of the last prompt token, logits of one decode step after it)."""
    cache = model.make_cache(1, 64)
    x = torch.tensor([ids])
    pre = model.forward(x, torch.arange(len(ids))[None], torch.tensor([0]), cache)[0, -1]
    one = model.forward(torch.tensor([[ids[-1]]]), torch.tensor([[len(ids)]]),
                        torch.tensor([0]), cache)[0, -1]
    return pre, one


def test_half_copies_serve_small_steps_and_float32_serves_the_rest(tiny_llama_dir):
    full = nbserve.load(str(tiny_llama_dir), verbose=False).model
    mixed = nbserve.load(str(tiny_llama_dir), weights="mixed16", verbose=False).model
    assert mixed.weight_format == "mixed16" and full.weight_format == "float32"
    ids = [3, 17, 5, 9, 11, 2]
    (pre_f, one_f), (pre_m, one_m) = _steps(full, ids), _steps(mixed, ids)
    torch.testing.assert_close(pre_m, pre_f, rtol=1e-5, atol=1e-5)  # 6 rows: float32 weights
    assert not torch.equal(one_m, one_f)  # 1 row: the float16 copies ran ...
    torch.testing.assert_close(one_m, one_f, rtol=0, atol=2e-2)  # ... and stay close
    assert one_m.dtype == torch.float32

    n_full, bytes_full = count_parameters(full)
    n_mixed, bytes_mixed = count_parameters(mixed)
    assert n_mixed == n_full and bytes_mixed > bytes_full  # the copies are counted


def test_half_copy_applies_to_one_or_two_float32_rows_only():
    h = HalfCopy(torch.randn(8, 4))
    assert h.applies(torch.randn(1, 4)) and h.applies(torch.randn(FLOAT16_MAX_ROWS, 1, 4))
    assert not h.applies(torch.randn(FLOAT16_MAX_ROWS + 1, 4))
    assert not h.applies(torch.randn(1, 4).double())
    torch.testing.assert_close(h(torch.ones(1, 4)), torch.ones(1, 4) @ h.weight.float().t(),
                               rtol=1e-3, atol=1e-3)  # float16 output rounding


def test_mixed16_errors_say_what_to_do(tiny_llama_dir):
    with pytest.raises(ValueError, match="applies to checkpoints nbserve loads itself"):
        nbserve.load(torch.nn.Linear(2, 2), weights="mixed16")
    with pytest.raises(ValueError, match="mixed16"):  # listed among the valid names
        nbserve.load(str(tiny_llama_dir), dtype="float8")
    model = nbserve.load(str(tiny_llama_dir), dtype="bfloat16", verbose=False).model
    with pytest.raises(ValueError, match="CPU float32 option"):
        model.use_16bit_weights()


@pytest.mark.slow
def test_default_model_keeps_its_answer_with_mixed16():
    engine = nbserve.Engine(nbserve.load("smollm2", weights="mixed16", verbose=False),
                            max_batch=2, max_context=256, quiet=True)
    with engine:
        answer = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                             max_tokens=16, temperature=0)
    assert answer == "The capital of France is Paris."


@pytest.mark.parametrize("fmt", ["mixed16", "quantized", "quantized-exact"])
def test_cli_and_launch_pass_the_weight_format_to_the_loader(tiny_llama_dir, fmt):
    from nbserve.models.decoder import kernels_available
    from nbserve.models.dtypes import load_kwargs
    from nbserve.serving.backend_ref import build_backend
    from nbserve.serving.cli import build_parser, serve_kwargs

    if fmt.startswith("quantized") and not kernels_available():
        pytest.skip("weights='blocks' needs nbserve's C kernels (a C compiler)")

    options = load_kwargs(fmt)  # weights= (and exact=True)
    flags = ["--weights", str(options["weights"])] + ["--exact"] * ("exact" in options)
    args = build_parser().parse_args(["serve", str(tiny_llama_dir), *flags])
    assert {k: serve_kwargs(args)[k] for k in options} == options
    backend, owned = build_backend(str(tiny_llama_dir), **options, max_batch=2,
                                   max_context=64, quiet=True)
    with backend:
        assert backend.model.weight_format == fmt
        assert backend.complete("hi", max_tokens=3, temperature=0) is not None


def test_moving_the_model_rebuilds_what_derives_from_its_weights(tiny_llama_dir):
    model = nbserve.load(str(tiny_llama_dir), weights="mixed16", verbose=False).model
    ids = torch.tensor([[3, 17, 5]])

    def logits(m):
        return m.forward(ids, torch.arange(3)[None], torch.tensor([0]), m.make_cache(1, 16))

    before = logits(model)
    model.to(torch.float64)  # .to() moves parameters and buffers, not plain attributes
    assert model.weight_format == "float64" and model._head_t is None
    att = model.model.layers[0].self_attn
    assert att.q_proj.weight.untyped_storage().data_ptr() == att.qkv_weight.data_ptr()
    torch.testing.assert_close(logits(model).float(), before, rtol=1e-4, atol=1e-4)
    model.to(torch.float32)  # back on CPU float32: the float16 copies come back
    assert model.weight_format == "mixed16" and model._head_t is None
    one = model.forward(ids[:, :1], torch.tensor([[0]]), torch.tensor([0]), model.make_cache(1, 8))
    assert one.dtype == torch.float32
