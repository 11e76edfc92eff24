"""The paged-KV-cache attention kernels (kernels/paged_attention.c) against plain torch.

The reference gathers a sequence's blocks in table order into a contiguous context and runs
grouped-query attention in float64. Block tables are scattered (not 0, 1, 2, ...), rows share
prefix blocks, lengths end mid-block and on a block boundary, unused table entries are -1. Each
kernel runs on every code path (AVX-512 where this CPU has it, AVX2, plain C), as in
test_quantized.py; the lone kernel must write k (roped) and v where the table says and nowhere
else, and equal the contiguous lone kernel when the table is 0, 1, 2, ...
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from kernel_paths import NEEDS_COMPILER, PATHS

from nbserve.cpu.kernels import build
from nbserve.execution.paged_attention import (
    paged_attention_serves,
    paged_cache_serves,
    paged_decode_attention,
    paged_lone_attention,
)
from nbserve.models.rope import apply_rope

pytestmark = NEEDS_COMPILER
HEADS = [pytest.param(6, 2, id="gqa-6-2"), pytest.param(4, 4, id="mha-4-4")]
D = 32


@pytest.fixture(scope="module", params=PATHS)
def kernels(request) -> ctypes.CDLL:
    return build.quant_kernels(request.param)


@pytest.fixture(params=[1, 7], ids=["1-thread", "7-threads"])
def threads(request):
    """7 threads: more than (row, kv head) pairs, so a group's query heads are split."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=[torch.float32, torch.float16], ids=["f32-cache", "f16-cache"])
def cache_dtype(request) -> torch.dtype:
    return request.param


def _cache(n_blocks: int, hkv: int, block_size: int, seed: int,
           dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (n_blocks, hkv, block_size, D)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _tables(lengths: list[int], block_size: int, n_blocks: int, seed: int,
            share: int = 0) -> torch.Tensor:
    """Scattered block tables (a random order of the pool), padded with -1; rows 0 and 1 share
    their first `share` blocks (a common prefix)."""
    need = [-(-n // block_size) for n in lengths]
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(need) + 1  # one more column than any row needs: never read
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        if b == 1 and share:
            row = tables[0, :share].tolist() + [order.pop() for _ in range(n - share)]
        else:
            row = [order.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(row, dtype=torch.int32)
    return tables


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's (hkv, length, d) context from the paged cache, blocks in table order."""
    n = -(-length // cache.shape[2])
    blocks = cache[table[:n].long()]  # (n, hkv, bs, d)
    return blocks.permute(1, 0, 2, 3).reshape(cache.shape[1], -1, D)[:, :length]


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               table: torch.Tensor, length: int) -> torch.Tensor:
    """One row's attention in float64: q (hq, d) -> (hq * d,)."""
    hq, hkv = q.shape[0], keys.shape[1]
    if length == 0:
        return torch.zeros(hq * D)
    k = _gather(keys, table, length).double()
    v = _gather(values, table, length).double()
    qg = q.view(hkv, hq // hkv, D).double()
    scores = qg @ k.transpose(1, 2) / D ** 0.5
    return (torch.softmax(scores, -1) @ v).reshape(hq * D).float()


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_decode_batch_matches_torch(kernels, threads, block_size, hq, hkv, cache_dtype):
    # mid-block, exactly on a block boundary, one token, several blocks, a shared prefix (row 1)
    lengths = [2 * block_size + 3, 3 * block_size, 1, 5 * block_size - 1, block_size + 1]
    lengths[1] = max(lengths[1], 2 * block_size + 1)
    n_blocks = sum(-(-n // block_size) for n in lengths) + 3  # a few blocks no row uses
    keys, values = _cache(n_blocks, hkv, block_size, seed=block_size, dtype=cache_dtype)
    tables = _tables(lengths, block_size, n_blocks, seed=hq, share=2)
    assert torch.equal(tables[0, :2], tables[1, :2])
    q = torch.randn(len(lengths), hq, D)
    before = (keys.clone(), values.clone())
    for rows in (slice(0, 5), slice(3, 4)):  # B=5 with different lengths, and B=1
        lens = torch.tensor(lengths, dtype=torch.int32)[rows].contiguous()
        out = paged_decode_attention(q[rows].contiguous(), keys, values, block_size,
                                     tables[rows].contiguous(), lens, kernels=kernels)
        assert out.shape == (lens.shape[0], hq * D)
        want = torch.stack([_reference(q[rows][b], keys, values, tables[rows][b], int(n))
                            for b, n in enumerate(lens)])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])  # read only


@pytest.mark.parametrize("group", [2, 3, 4, 5, 7, 8])
def test_each_query_head_of_a_group_gets_what_it_gets_alone(kernels, group, cache_dtype):
    """The vector kernel reads each key and value once for several query heads of a kv head
    (a few at a time); every head's output must be, bit for bit, what that head gets as the
    only query head of its kv head (and close to float64)."""
    hkv, block_size = 2, 16
    lengths = [block_size * 2 + 5, 7, block_size * 3]
    n_blocks = sum(-(-n // block_size) for n in lengths) + 2
    keys, values = _cache(n_blocks, hkv, block_size, seed=group, dtype=cache_dtype)
    tables = _tables(lengths, block_size, n_blocks, seed=group)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), hkv * group, D, generator=torch.Generator().manual_seed(3))
    out = paged_decode_attention(q, keys, values, block_size, tables, lens, kernels=kernels)
    out = out.view(len(lengths), hkv * group, D)
    for h in range(hkv * group):
        kh = h // group
        alone = paged_decode_attention(
            q[:, h:h + 1].contiguous(), keys[:, kh:kh + 1].contiguous(),
            values[:, kh:kh + 1].contiguous(), block_size, tables, lens, kernels=kernels)
        assert torch.equal(out[:, h], alone), f"head {h} of group {group}"
    want = torch.stack([_reference(q[b], keys, values, tables[b], n)
                        for b, n in enumerate(lengths)])
    torch.testing.assert_close(out.reshape(len(lengths), -1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_lone_step_writes_through_the_table_and_attends(kernels, threads, block_size, hq, hkv,
                                                        cache_dtype):
    n_blocks = 7 * 32 // block_size + 2 if block_size > 1 else 80
    positions = sorted({0, block_size - 1, block_size, 2 * block_size + 5, 3 * block_size - 1})
    positions = [p for p in positions if p < 70]
    table = _tables([positions[-1] + 1], block_size, n_blocks, seed=block_size)[0].contiguous()
    keys, values = _cache(n_blocks, hkv, block_size, seed=hq, dtype=cache_dtype)
    for pos in positions:
        heads = torch.randn(hq + 2 * hkv, D)
        angles = torch.rand(D // 2) * (pos + 1)
        rope = (torch.cat([angles.cos()] * 2), torch.cat([-angles.sin(), angles.sin()]))
        qk = apply_rope(heads[:hq + hkv], *rope)
        want_k, want_v = keys.clone(), values.clone()
        block, offset = int(table[pos // block_size]), pos % block_size
        # stored in the cache's type, rounded as torch rounds (to nearest even)
        want_k[block, :, offset] = qk[hq:].to(cache_dtype)
        want_v[block, :, offset] = heads[hq + hkv:].to(cache_dtype)
        assert paged_attention_serves(heads, *rope) and paged_cache_serves(keys, values)
        out = paged_lone_attention(heads, hq, hkv, rope, keys, values, block_size, table, pos,
                                   kernels=kernels)
        # the whole cache: k (rope rounded as torch's) and v at the slot, nothing else touched
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        want = _reference(qk[:hq], keys, values, table, pos + 1)[None]
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_decode_step_ropes_writes_and_attends_a_batch(kernels, threads, block_size, hq, hkv,
                                                      cache_dtype):
    """The batched decode step in one call: the same cache writes (bit for bit) and the same
    outputs (the same attention kernel after them) as torch's rope and writes followed by
    paged_decode_attention; each row with its own position and rope."""
    from nbserve.execution.paged_attention import paged_decode_step

    positions = [2 * block_size + 3, 0, 3 * block_size - 1, block_size]  # mid, first, last
    lengths = [p + 1 for p in positions]
    n_blocks = sum(-(-n // block_size) for n in lengths) + 3
    keys, values = _cache(n_blocks, hkv, block_size, seed=7, dtype=cache_dtype)
    tables = _tables(lengths, block_size, n_blocks, seed=hkv)
    heads = torch.randn(len(positions), hq + 2 * hkv, D)
    angles = torch.rand(len(positions), D // 2) * torch.tensor(lengths)[:, None]
    rope = (torch.cat([angles.cos()] * 2, dim=1), torch.cat([-angles.sin(), angles.sin()], 1))
    want_k, want_v = keys.clone(), values.clone()
    q = torch.empty(len(positions), hq, D)
    for b, pos in enumerate(positions):
        qk = apply_rope(heads[b, :hq + hkv], rope[0][b], rope[1][b])
        block, offset = int(tables[b, pos // block_size]), pos % block_size
        want_k[block, :, offset] = qk[hq:].to(cache_dtype)
        want_v[block, :, offset] = heads[b, hq + hkv:].to(cache_dtype)
        q[b] = qk[:hq]
    out = paged_decode_step(heads, hq, hkv, rope, keys, values, block_size, tables,
                            torch.tensor(positions, dtype=torch.int32), kernels=kernels)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)  # nothing else touched
    want = paged_decode_attention(q, keys, values, block_size, tables,
                                  torch.tensor(lengths, dtype=torch.int32), kernels=kernels)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="invalid arguments"):  # a position past its table
        paged_decode_step(heads, hq, hkv, rope, keys, values, block_size, tables,
                          torch.tensor([10**6, 0, 0, 0], dtype=torch.int32), kernels=kernels)


def test_a_row_of_length_zero_gets_zeros_and_an_empty_batch_nothing():
    keys, values = _cache(4, 2, 16, seed=0)
    q = torch.randn(2, 6, D)
    tables = torch.tensor([[2, -1], [-1, -1]], dtype=torch.int32)
    out = paged_decode_attention(q, keys, values, 16, tables, torch.tensor([5, 0],
                                                                           dtype=torch.int32))
    torch.testing.assert_close(out[0], _reference(q[0], keys, values, tables[0], 5),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros(6 * D))
    empty = paged_decode_attention(q[:0], keys, values, 16, tables[:0],
                                   torch.zeros(0, dtype=torch.int32))
    assert empty.shape == (0, 6 * D)


def test_bad_arguments_are_refused_before_anything_is_read_or_written():
    keys, values = _cache(4, 2, 16, seed=0)
    heads, rope = torch.randn(10, D), (torch.ones(D), torch.zeros(D))
    q = torch.randn(1, 6, D)
    lengths = torch.tensor([20], dtype=torch.int32)
    before = (keys.clone(), values.clone())
    with pytest.raises(ValueError, match="outside 0..3"):  # past the pool
        paged_decode_attention(q, keys, values, 16, torch.tensor([[1, 4]], dtype=torch.int32),
                               lengths)
    with pytest.raises(ValueError, match="invalid arguments"):  # a used entry is -1 (C's check)
        paged_decode_attention(q, keys, values, 16, torch.tensor([[1, -1]], dtype=torch.int32),
                               lengths, check=False)
    with pytest.raises(ValueError, match="invalid arguments"):  # 40 positions, 2 blocks of 16
        paged_decode_attention(q, keys, values, 16, torch.tensor([[1, 2]], dtype=torch.int32),
                               torch.tensor([40], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, keys, values, 16, torch.tensor([[1, 2]]), lengths)
    with pytest.raises(ValueError, match="do not fit"):  # 5 query heads over 2 kv heads
        paged_decode_attention(torch.randn(1, 5, D), keys, values, 16,
                               torch.tensor([[1, 2]], dtype=torch.int32), lengths)
    with pytest.raises(ValueError, match="not"):  # block size 8 is not the cache's
        paged_decode_attention(q, keys, values, 8, torch.tensor([[1, 2]], dtype=torch.int32),
                               lengths)
    with pytest.raises(ValueError, match="outside 0..3"):
        paged_lone_attention(heads, 6, 2, rope, keys, values, 16,
                             torch.tensor([0, 9], dtype=torch.int32), 17)
    with pytest.raises(ValueError, match="invalid arguments"):
        paged_lone_attention(heads, 6, 2, rope, keys, values, 16,
                             torch.tensor([0, -1], dtype=torch.int32), 17, check=False)
    with pytest.raises(ValueError, match="do not fit"):  # position 40 needs a third block
        paged_lone_attention(heads, 6, 2, rope, keys, values, 16,
                             torch.tensor([0, 1], dtype=torch.int32), 40)
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])
    assert not paged_attention_serves(heads, keys.transpose(2, 3), values)  # strided
    assert not paged_attention_serves(heads.double(), keys, values)


@pytest.mark.parametrize("d", [8, 20, 64, 80, 128])
def test_every_head_dim_matches_torch(kernels, d, cache_dtype):
    """Head dims of the models served (64 SmolLM2/Llama, 80 Phi, 128 Qwen3/Llama 3): whole
    vectors (the output 64 dims at a time), a partial chunk (80), and one no vector fits (20)."""
    block_size, hq, hkv, lengths = 16, 6, 2, [37, 16, 3, 100]
    n_blocks = sum(-(-n // block_size) for n in lengths) + 2
    g = torch.Generator().manual_seed(d)
    shape = (n_blocks, hkv, block_size, d)
    keys = torch.randn(shape, generator=g).to(cache_dtype)
    values = torch.randn(shape, generator=g).to(cache_dtype)
    tables = _tables(lengths, block_size, n_blocks, seed=d)
    q = torch.randn(len(lengths), hq, d, generator=g) * 2  # sharper softmax than randn
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = paged_decode_attention(q, keys, values, block_size, tables, lens, kernels=kernels)
    for b, n in enumerate(lengths):
        blocks = keys[tables[b, :-(-n // block_size)].long()], \
            values[tables[b, :-(-n // block_size)].long()]
        k, v = (x.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n].double() for x in blocks)
        qg = q[b].view(hkv, hq // hkv, d).double()
        want = torch.softmax(qg @ k.transpose(1, 2) / d ** 0.5, -1) @ v
        torch.testing.assert_close(out[b], want.reshape(hq * d).float(), rtol=1e-5, atol=1e-5)
