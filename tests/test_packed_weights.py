"""oneDNN-packed copies of the matmul weights (`PackedCopy`, `LlamaModel.pack_weights`)."""

from __future__ import annotations

import copy

import pytest
import torch

import nbserve
from nbserve.execution.formats import Float16Form, Float32Form
from nbserve.execution.holders import linear
from nbserve.execution.linear import PackedCopy, packing_available
from nbserve.execution.weights import count_parameters
from nbserve.models.decoder import LlamaModel

pytestmark = pytest.mark.skipif(not packing_available(torch.zeros(2, 2)),
                                reason="torch built without oneDNN")


def _logits(model: LlamaModel, rows: int) -> torch.Tensor:
    """One decode step of `rows` sequences after an 8-token prefill each."""
    torch.manual_seed(0)
    cache = model.make_cache(rows, 32)
    ids = torch.randint(0, model.vocab_size, (rows, 8))
    slots = torch.arange(rows)
    model.forward(ids, torch.arange(8).expand(rows, 8), slots, cache)
    return model.forward(ids[:, -1:], torch.full((rows, 1), 8), slots, cache)[:, -1]


@pytest.mark.parametrize("shape", [(1, 24), (16, 24), (2, 3, 24)])
def test_packed_copy_computes_the_linear_layer(shape):
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = PackedCopy(weight, bias)
    x = torch.randn(*shape)
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5)
    again = copy.deepcopy(packed)  # oneDNN tensors have no storage: the copy re-packs
    torch.testing.assert_close(again(x), packed(x), rtol=0, atol=0)


def _packed(holder):
    """A holder's packed copy, None where its form has none."""
    form = holder.form
    return form.packed if isinstance(form, (Float32Form, Float16Form)) else None


def test_loaders_pack_cpu_float32_models_and_the_packed_copies_serve(tiny_llama_dir,
                                                                    monkeypatch):
    monkeypatch.setenv("NBSERVE_KERNELS", "0")  # else the C kernel serves up to 4 rows
    packed = nbserve.load(str(tiny_llama_dir), verbose=False).model
    plain = copy.deepcopy(packed)
    for holder in plain._weight_holders():
        holder.form = None  # the plain weight, without its packed copy
    plain._wants["packed"] = False
    assert all(_packed(h) is not None for h in packed._weight_holders())
    assert packed._head_t is None  # the packed head replaces the transposed copy
    calls: list[int] = []
    run = PackedCopy.__call__
    monkeypatch.setattr(PackedCopy, "__call__", lambda self, x: calls.append(1) or run(self, x))
    for rows in (1, 4, 16):
        calls.clear()
        a, b = _logits(packed, rows), _logits(plain, rows)
        # prefill and decode, each: 4 matmuls a layer and the LM head, all packed
        assert len(calls) == 2 * (4 * packed.config.num_hidden_layers + 1)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the same result
    (n_packed, bytes_packed), (n_plain, bytes_plain) = (count_parameters(packed),
                                                        count_parameters(plain))
    assert n_packed == n_plain and bytes_packed > bytes_plain  # the copies are counted


def test_packing_follows_the_weights_across_dtype_changes(tiny_llama_dir):
    model = nbserve.load(str(tiny_llama_dir), verbose=False).model
    before = _logits(model, 2)
    model.to(torch.float64)  # oneDNN packing is float32-only: dropped, not left stale
    assert all(_packed(h) is None for h in model._weight_holders())
    torch.testing.assert_close(_logits(model, 2).float(), before, rtol=1e-4, atol=1e-4)
    model.to(torch.float32)
    assert all(_packed(h) is not None for h in model._weight_holders())
    torch.testing.assert_close(_logits(model, 2), before, rtol=0, atol=0)


def test_mixed16_keeps_packed_copies_for_batches(tiny_llama_dir):
    model = nbserve.load(str(tiny_llama_dir), weights="mixed16", verbose=False).model
    holder = model._weight_holders()[0]
    assert isinstance(holder.form, Float16Form) and holder.form.packed is not None
    calls = []
    real = holder.form.packed

    class Spy:
        def __call__(self, x):
            calls.append(x.shape[:-1].numel())
            return real(x)

    holder.form.packed = Spy()
    linear(torch.randn(1, holder.weight.shape[1]), holder)  # one row: the float16 copy
    linear(torch.randn(8, holder.weight.shape[1]), holder)  # a batch: the packed copy
    assert calls == [8]


def test_pack_weights_says_what_it_needs(tiny_llama_dir):
    model = nbserve.load(str(tiny_llama_dir), dtype="bfloat16", verbose=False).model
    with pytest.raises(ValueError, match="CPU float32 model"):
        model.pack_weights()


def test_loaders_skip_packing_when_the_copies_would_crowd_the_memory(tiny_llama_dir,
                                                                     monkeypatch):
    from nbserve.execution import linear as linear_module

    assert linear_module.packing_affordable(1 << 20)  # a MiB fits on any machine we run on
    monkeypatch.setattr(linear_module, "PACK_MEMORY_SHARE", 0.0)  # as if the model were huge
    model = nbserve.load(str(tiny_llama_dir), verbose=False).model
    assert all(_packed(h) is None for h in model._weight_holders())
    assert model._head_t is not None  # the older single-row head copy instead
    assert _logits(model, 2).shape == (2, model.vocab_size)


def test_the_load_line_shows_the_copies_apart_from_the_weights(tiny_llama_dir):
    from nbserve.loading import summary_line

    loaded = nbserve.load(str(tiny_llama_dir), verbose=False)
    copies = loaded.model.derived_bytes()
    line = summary_line(loaded, 1.0)
    assert copies > 0 and f"+ {copies / 2**20:.0f} MiB of copies for speed" in line, line
    plain = nbserve.load(str(tiny_llama_dir), dtype="bfloat16", verbose=False)  # no copies
    assert "copies" not in summary_line(plain, 1.0)


def test_a_row_or_two_are_padded_to_the_faster_kernel_and_keep_their_values():
    from nbserve.execution.linear import PACK_MIN_ROWS

    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = PackedCopy(weight, bias)
    seen = []
    real = packed._matmul
    packed._matmul = lambda x: seen.append(tuple(x.shape)) or real(x)
    for shape in [(1, 24), (2, 24), (1, 1, 24), (PACK_MIN_ROWS, 24)]:
        x = torch.randn(*shape)
        y = packed(x)
        assert y.shape == (*shape[:-1], 40)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)
        padded = torch.cat([x.reshape(-1, 24), torch.zeros(PACK_MIN_ROWS, 24)])[:PACK_MIN_ROWS]
        assert torch.equal(y.reshape(-1, 40), real(padded)[:y.numel() // 40])
    assert seen == [(PACK_MIN_ROWS, 24)] * 4  # 1, 2, 1 rows padded; 4 rows as they are


def test_row_buckets_pad_less_than_an_eighth_and_bound_the_shapes():
    from nbserve.execution.linear import PACK_EXACT_ROWS, PACK_MIN_ROWS, packed_rows

    for rows in range(1, 5000):
        target = packed_rows(rows)
        assert target >= max(rows, PACK_MIN_ROWS)
        if PACK_MIN_ROWS <= rows <= PACK_EXACT_ROWS:
            assert target == rows
        else:
            assert target - rows < max(rows / 8, PACK_MIN_ROWS), (rows, target)
        assert packed_rows(target) == target  # a bucket is its own bucket
    # every prompt length up to 4096 tokens runs as one of few shapes (oneDNN keeps memory
    # for each shape it has run: unbounded shapes grew a float32 server by gigabytes)
    assert len({packed_rows(r) for r in range(1, 4097)}) <= PACK_EXACT_ROWS + 8 * 8


def test_bucketed_rows_keep_their_values():
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = PackedCopy(weight, bias)
    seen = []
    real = packed._matmul
    packed._matmul = lambda x: seen.append(x.shape[0]) or real(x)
    for rows in (17, 33, 100, 257):
        x = torch.randn(rows, 24)
        y = packed(x)
        assert y.shape == (rows, 40)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)
    assert seen == [18, 36, 104, 288]
