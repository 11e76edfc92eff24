"""The CPU split linear layer: same values as F.linear, and only where it is meant to apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nbserve.cpu.threads import torch_threads
from nbserve.execution.linear import SPLIT_MAX_ROWS, split_linear, split_ways


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 48), (1, 5, 48), (3, 1, 48), (16, 1, 48), (200, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear(threads, shape, bias):
    g = torch.Generator().manual_seed(threads)
    w = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    with torch_threads(threads):
        got = split_linear(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_splits_only_small_float32_cpu_inputs_it_can_divide():
    w = torch.randn(96, 48)
    with torch_threads(2):
        assert split_ways(torch.randn(1, 48), w) == 2
        assert split_ways(torch.randn(SPLIT_MAX_ROWS, 48), w) == 2
        assert split_ways(torch.randn(SPLIT_MAX_ROWS + 1, 48), w) == 1  # big GEMMs thread well
        assert split_ways(torch.randn(1, 48).half(), w.half()) == 1  # 16-bit: own kernels
        assert split_ways(torch.randn(1, 48), torch.randn(48, 96).t()) == 1  # not contiguous
        assert split_ways(torch.randn(1, 48), torch.randn(95, 48)) == 1  # 95 rows: no halves
    with torch_threads(1):
        assert split_ways(torch.randn(1, 48), w) == 1


def test_torch_threads_restores_the_callers_setting():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_bfloat16_runs_in_row_buckets_with_the_same_rows_out(monkeypatch):
    """oneDNN's bfloat16 GEMM keeps memory for every row count it has run: split_linear pads
    bfloat16 inputs of more than PACK_EXACT_ROWS rows to the row buckets (a few rows run as
    they are), and returns the real rows' outputs."""
    from nbserve.execution import linear as L

    seen = []
    real = F.linear
    monkeypatch.setattr(L.F, "linear", lambda x, w, b=None: seen.append(x.shape[0]) or
                        real(x, w, b))
    w = torch.randn(40, 24).to(torch.bfloat16)
    b = torch.randn(40).to(torch.bfloat16)
    for rows in (1, 3, 16, 17, 33, 100):
        x = torch.randn(rows, 24).to(torch.bfloat16)
        got = L.split_linear(x, w, b)
        assert got.shape == (rows, 40)
        torch.testing.assert_close(got, real(x, w, b))
    assert seen == [1, 3, 16, 18, 36, 104]
    seen.clear()
    x = torch.randn(5, 7, 24).to(torch.bfloat16)  # (batch, tokens, hidden): 35 rows
    assert L.split_linear(x, w, b).shape == (5, 7, 40) and seen == [36]
