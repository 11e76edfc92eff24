"""NBQ_ROUND8 (cpu/kernels/gguf_blocks_round8.h, gguf_blocks_gemm8.h): Q4_K and Q6_K products over
the input rounded to 8 bits per 256 as llama.cpp's Q8_K (scale max |x| / 127, codes rint(x /
scale) in [-127, 127]) and multiplied in integers (the row kernels up to 8 rows, gemm8 past 8
where the build has it); NBQ_ROUND8_MANY alone: the same past 8 rows where gemm8 takes them,
rounded per 32. On every build that has the kernels (AVX-512, AVX2) equal to the float64
product of that rounded input with gguf's dequantized weights up to float32 rounding, the
largest codes and scales included; where a build or a type has none (plain C; the other types),
exactly what the call gives without the flag. Then the serving side: the flag is set by default
(NBSERVE_ROUND8=0 unsets it) on the weights that allow rounding, decode steps take it at any
batch size, prompt chunks take NBQ_ROUND8_MANY (NBSERVE_ROUND8=decode: nothing, all: NBQ_ROUND8),
and the one-call decode stack passes it on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_util import hf_dir_to_gguf
from kernel_paths import NEEDS_COMPILER, PATHS
from test_block_kernels import _kernels, _random_blocks, _reference
from test_decode_stack import _decode, _equal
from tiny_models import make_tiny_hf_dir

import nbserve
from nbserve.cpu.kernels.abi import KernelFlag
from nbserve.cpu.kernels.blocks import (
    BlockType,
    block_layout,
    blocks_matmul,
    blocks_rounded,
    blocks_rounded8,
    blocks_rounded8_many,
)
from nbserve.cpu.kernels.build import _cpu_flags
from nbserve.execution.decode_stack import unfit_reason

pytestmark = NEEDS_COMPILER
ROUNDED8 = [BlockType.Q4_K, BlockType.Q6_K]


def _round8(x: torch.Tensor, per: int = 256) -> torch.Tensor:
    """The kernels' 8-bit input (round8) as float64: per `per` inputs (256: the row kernels',
    32: gemm8's), s = max |x| / 127 and q = rint(x * (127 / max |x|)) in float32 (ties to even,
    as the CPU's conversion), clamped to [-127, 127]; the input q s."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // per, per)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.round(blocks * inv).clamp(-127, 127)
    scale = amax / torch.tensor(127.0)
    return (q.double() * scale.double()).reshape(rows, k)


def _many(rows: int, block_type: BlockType, lib) -> bool:
    """Whether round8_many takes a product of `rows` rows on this build (gemm8's, per 32)."""
    return rows > 8 and blocks_rounded8_many(block_type, lib)


def _product(x, block_type, blocks, n, k, lib, **flags) -> torch.Tensor:
    return blocks_matmul(x, block_type, blocks, n, k, lib=lib, threads=2, **flags).double()


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", ROUNDED8, ids=[t.name for t in ROUNDED8])
def test_round8_multiplies_the_input_rounded_to_8_bits(arch, block_type):
    """1 to 8, 16 and 70 rows (a batch, a prefill chunk past the row-chunk size), k from 256
    to 4096: the float64 product of the 8-bit input with gguf's weights, within 1e-6 of the
    products' sizes (measured within 6e-8); that input is far from the exact one here (the
    exact product is outside that tolerance), so a kernel ignoring the flag fails. With round16
    as well, round8 wins. A build without the kernels (plain C) gives bit for bit what it gives
    without the flag."""
    lib = _kernels(arch)
    g = torch.Generator().manual_seed(int(block_type))
    for k, n in ((256, 5), (1024, 7), (4096, 3)):
        raw = _random_blocks(block_type, n, k, seed=k + n)
        w = _reference(raw, block_type, n, k).double()
        blocks = torch.from_numpy(raw.reshape(-1).copy())
        for rows in (*range(1, 9), 16, 70):
            x = torch.randn(rows, k, generator=g)
            x[:, ::64] *= 20
            got = _product(x, block_type, blocks, n, k, lib, round8=True)
            both = _product(x, block_type, blocks, n, k, lib, round8=True, round16=True)
            if not blocks_rounded8(block_type, lib):
                assert torch.equal(got, _product(x, block_type, blocks, n, k, lib))
                assert torch.equal(both, _product(x, block_type, blocks, n, k, lib,
                                                  round16=True))
                continue
            want, exact = _round8(x) @ w.t(), x.double() @ w.t()
            size = x.double().abs() @ w.abs().t()
            assert bool(((got - want).abs() <= 1e-6 * size).all()), \
                float(((got - want).abs() / size).max())
            assert torch.equal(both, got)
            assert bool(((exact - want).abs() > 1e-6 * size).any())  # the flag matters here
            many = _product(x, block_type, blocks, n, k, lib, round8_many=True)
            if _many(rows, block_type, lib):  # gemm8's share, per 32
                per32 = _round8(x, 32) @ w.t()
                assert bool(((many - per32).abs() <= 1e-6 * size).all())
                assert bool(((per32 - want).abs() > 1e-6 * size).any())  # not per 256
                assert torch.equal(_product(x, block_type, blocks, n, k, lib, round8=True,
                                            round8_many=True), got)  # round8 wins
            else:  # not gemm8's: as without the flag
                assert torch.equal(many, _product(x, block_type, blocks, n, k, lib))


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", ROUNDED8, ids=[t.name for t in ROUNDED8])
def test_round8_gives_a_row_the_same_bits_in_any_batch(arch, block_type):
    """With 8-bit inputs a row's product does not depend on the rows beside it: each of 1, 3,
    16 and 130 rows (two row chunks and a part) is bit for bit that row's product in any batch
    of the same regime -- up to 8 rows (the row kernels: that row alone) or more (gemm8 where
    the build has it, else the row kernels again) -- so a stream's greedy answer does not move
    with the concurrency inside either. Across the two regimes gemm8 sums the same integers in
    another float order: equal to float32 rounding, and still the 8-bit input's product. The
    same for gemm8 over the input rounded per 32 (round8_many) in any batch of more than 8.
    (Past 8 rows the products took the exact float32 panels before: not bit for bit.)"""
    lib = _kernels(arch)
    if not blocks_rounded8(block_type, lib):
        pytest.skip("this build has no 8-bit row kernels")
    k, n = 1024, 19  # 16 weight rows built at a time: a group and a part
    raw = _random_blocks(block_type, n, k, seed=3)
    blocks = torch.from_numpy(raw.reshape(-1).copy())
    w = _reference(raw, block_type, n, k).double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(130, k, generator=g)
    many = _product(x, block_type, blocks, n, k, lib, round8=True)
    alone = torch.cat([_product(x[i:i + 1], block_type, blocks, n, k, lib, round8=True)
                       for i in range(len(x))])
    for start, stop in ((0, 3), (5, 13), (120, 128)):  # up to 8 rows: the row path
        assert torch.equal(_product(x[start:stop], block_type, blocks, n, k, lib, round8=True),
                           alone[start:stop]), (start, stop)
    for start, stop in ((0, 9), (7, 23), (1, 130), (64, 130)):  # more: gemm8 (or the rows)
        assert torch.equal(_product(x[start:stop], block_type, blocks, n, k, lib, round8=True),
                           many[start:stop]), (start, stop)
    if not blocks_rounded8_many(block_type, lib):
        assert torch.equal(many, alone)
    size = x.double().abs() @ w.abs().t()
    assert bool(((many - alone).abs() <= 1e-6 * size).all())
    assert bool(((many - _round8(x) @ w.t()).abs() <= 1e-6 * size).all())
    if blocks_rounded8_many(block_type, lib):
        per32 = _product(x, block_type, blocks, n, k, lib, round8_many=True)
        for start, stop in ((0, 9), (7, 23), (64, 130)):
            assert torch.equal(_product(x[start:stop], block_type, blocks, n, k, lib,
                                        round8_many=True), per32[start:stop]), (start, stop)


@pytest.mark.parametrize("arch", PATHS)
def test_round8_is_served_for_q4_k_and_q6_k_where_the_build_rounds(arch):
    """Q4_K and Q6_K have 8-bit row kernels on the AVX2 and AVX-512 builds, no other type has,
    and the plain C build has none."""
    lib = _kernels(arch)
    served = {t for t in BlockType if blocks_rounded8(t, lib)}
    assert served == (set() if lib.nbq_simd_width() == 1 else set(ROUNDED8))
    many = {t for t in BlockType if blocks_rounded8_many(t, lib)}  # gemm8: AVX2, AVX-512 VNNI
    width = lib.nbq_simd_width()
    gemm8 = width == 8 or (width == 16 and "avx512_vnni" in _cpu_flags())
    assert many == (set(ROUNDED8) if gemm8 else set())


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", [BlockType.Q5_K, BlockType.Q8_0, BlockType.IQ4_XS],
                         ids=["Q5_K", "Q8_0", "IQ4_XS"])
def test_other_types_ignore_round8(arch, block_type):
    """For a type without 8-bit kernels the flag changes nothing: alone, the exact product; with
    round16, the 16-bit one (bit for bit)."""
    lib = _kernels(arch)
    elems, _ = block_layout(block_type, lib)
    n, k = 5, 2 * max(elems, 256)
    raw = _random_blocks(block_type, n, k, seed=3)
    blocks = torch.from_numpy(raw.reshape(-1).copy())
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    assert torch.equal(_product(x, block_type, blocks, n, k, lib, round8=True),
                       _product(x, block_type, blocks, n, k, lib))
    assert torch.equal(_product(x, block_type, blocks, n, k, lib, round8=True, round16=True),
                       _product(x, block_type, blocks, n, k, lib, round16=True))


def _extreme_blocks(block_type: BlockType, n: int, k: int) -> np.ndarray:
    """Blocks of the largest products: Q6_K scales -128 with codes 63 (row 0), 0 (row 1) and
    both (the rest); Q4_K scales and mins 63, codes 15 (row 0), 0 (row 1), both (the rest)."""
    elems, size = block_layout(block_type)
    half = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw = np.zeros((n, k // elems, size), np.uint8)
    if block_type == BlockType.Q6_K:
        raw[0, :, 0:192] = 0xFF  # ql and qh all ones: code 63
        raw[2:, :, 0:192:3] = 0xFF
        raw[..., 192:208] = 0x80  # int8 -128
        raw[..., 208:210] = half
    else:
        raw[..., 0:2] = raw[..., 2:4] = half
        raw[..., 4:16] = 0xFF  # 6-bit scales and mins 63
        raw[0, :, 16:] = 0xFF
        raw[2:, :, 16::5] = 0xFF
    return raw.reshape(n, -1)


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", ROUNDED8, ids=[t.name for t in ROUNDED8])
def test_round8_sums_of_the_largest_products_stay_exact(arch, block_type):
    """Input codes +-127 (inputs +-1, each block's largest) against the largest codes and
    scales: the int16 pairs (2 * 63 * 127) and int32 sums do not overflow, so the product is the
    float64 one, to float32 rounding; in the row kernels (4 rows) and in gemm8 (16 rows, per 256
    and per 32, where the build has it)."""
    lib = _kernels(arch)
    n, k = 4, 1024
    raw = _extreme_blocks(block_type, n, k)
    w = _reference(raw, block_type, n, k).double()
    blocks = torch.from_numpy(raw.reshape(-1).copy())
    signs = torch.ones(4, k)
    signs[1] = -1
    signs[2, ::2] = -1
    signs[3, : k // 2] = -1
    want = signs.double() @ w.t()  # inputs +-1 round to themselves, per 256 or per 32
    batch = signs.repeat(4, 1)
    for rows, flags in ((signs, {"round8": True}), (batch, {"round8": True}),
                        (batch, {"round8_many": True})):
        got = _product(rows, block_type, blocks, n, k, lib, **flags)
        assert torch.allclose(got, want.repeat(len(rows) // 4, 1), rtol=1e-6,
                              atol=1e-6 * float(want.abs().max())), flags


def test_the_environment_sets_round8_where_rounding_is_allowed(monkeypatch):
    """ROUND8 is in the flags of Q4_K and Q6_K weights served with rounding (weights="blocks")
    where the build has the kernels, by default (unset) and with NBSERVE_ROUND8=1 or all; never with
    NBSERVE_ROUND8=0, never with exact=True, never for other types; anything else is refused
    by name."""
    from nbserve.execution.quant import GGMLBlocks, KernelLinear

    lib = _kernels(None)
    weights = {}
    for block_type in (BlockType.Q4_K, BlockType.Q6_K, BlockType.Q5_K):
        _, size = block_layout(block_type, lib)
        raw = _random_blocks(block_type, 4, 512, seed=1)
        weights[block_type] = GGMLBlocks.of_file(raw.reshape(4, 2, size), block_type)
    for value in ("1", "0", "", "all", "decode"):
        monkeypatch.setenv("NBSERVE_ROUND8", value)
        for block_type, weight in weights.items():
            rounded = KernelLinear(weight, kernels=lib, round16=True).flags
            exact = KernelLinear(weight, kernels=lib, round16=False).flags
            want = value != "0" and blocks_rounded8(block_type, lib)
            assert bool(rounded & KernelFlag.ROUND8) == want
            assert exact == 0
    monkeypatch.setenv("NBSERVE_ROUND8", "yes")
    with pytest.raises(ValueError, match="NBSERVE_ROUND8='yes': use 1 or leave it unset"):
        KernelLinear(weights[BlockType.Q4_K], kernels=lib, round16=True)


def test_decode_rows_round_to_8_bits_and_long_prompt_chunks_take_gemm8(monkeypatch):
    """A KernelLinear over Q4_K blocks: an input of one position a sequence (batch, 1, k), 12
    rows, gives the 8-bit product of the 12 rows (what decode steps use at any batch size, per
    256); an input of several positions (a prompt chunk, (1, 12, k)) gemm8's product over the
    input rounded per 32 where the build has gemm8 and the product without ROUND8 (16-bit or
    float32 inputs) where it has not; a 5-position chunk never takes the row kernels' 8 bits
    per 256. NBSERVE_ROUND8=decode keeps every prompt chunk off 8 bits, NBSERVE_ROUND8=all puts
    every one on 8 bits per 256. (Before, prompt chunks kept 16 bits by default.)"""
    from nbserve.execution.quant import GGMLBlocks, KernelLinear

    lib = _kernels(None)
    if not blocks_rounded8(BlockType.Q4_K, lib):
        pytest.skip("this build has no 8-bit row kernels")
    k, n = 512, 6
    _, size = block_layout(BlockType.Q4_K, lib)
    raw = _random_blocks(BlockType.Q4_K, n, k, seed=2)
    weight = GGMLBlocks.of_file(raw.reshape(n, k // 256, size), BlockType.Q4_K)
    blocks = torch.from_numpy(raw.reshape(-1).copy())
    w = _reference(raw, BlockType.Q4_K, n, k).double()
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(9))
    x[:, ::64] *= 20
    size = x.double().abs() @ w.abs().t()
    alone8 = torch.cat([_product(x[i:i + 1], BlockType.Q4_K, blocks, n, k, lib, round8=True)
                        for i in range(12)])
    batch8 = _product(x, BlockType.Q4_K, blocks, n, k, lib, round8=True)  # gemm8 if built
    per32 = _product(x, BlockType.Q4_K, blocks, n, k, lib, round8_many=True)
    assert bool(((alone8 - _round8(x) @ w.t()).abs() <= 1e-6 * size).all())
    assert bool(((batch8 - _round8(x) @ w.t()).abs() <= 1e-6 * size).all())

    def chunks(mode: str | None) -> tuple[KernelLinear, torch.Tensor]:
        if mode is None:
            monkeypatch.delenv("NBSERVE_ROUND8", raising=False)
        else:
            monkeypatch.setenv("NBSERVE_ROUND8", mode)
        linear = KernelLinear(weight, kernels=lib, round16=True)
        assert torch.equal(linear(x.unsqueeze(1)).reshape(12, n).double(), batch8)
        without8 = _product(x, BlockType.Q4_K, blocks, n, k, lib,
                            round16=linear.flags & KernelFlag.ROUND16 != 0)
        return linear, without8

    linear, without8 = chunks(None)
    for positions in (12, 5):
        got = linear(x[:positions].unsqueeze(0)).reshape(positions, n).double()
        if _many(positions, BlockType.Q4_K, lib):
            assert torch.equal(got, per32)
            assert bool(((got - _round8(x, 32) @ w.t()).abs() <= 1e-6 * size).all())
        else:
            assert torch.equal(got, without8[:positions])
            assert not torch.equal(got, alone8[:positions])
    linear, without8 = chunks("decode")  # prompts at 16 bits
    for positions in (12, 5):
        got = linear(x[:positions].unsqueeze(0)).reshape(positions, n).double()
        assert torch.equal(got, without8[:positions])
    linear, _ = chunks("all")  # every prompt chunk
    assert torch.equal(linear(x.unsqueeze(0)).reshape(12, n).double(), batch8)
    assert torch.equal(linear(x[:5].unsqueeze(0)).reshape(5, n).double(), alone8[:5])


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    """A tiny Llama with rows of whole K-quant blocks as Q4_K, the down projections Q6_K (not v:
    q, k and v of two types are not one fused weight, which the stack needs)."""
    folder = tmp_path_factory.mktemp("round8")
    hf = make_tiny_hf_dir(folder / "hf", "llama", hidden_size=256, intermediate_size=512,
                          num_attention_heads=4, num_key_value_heads=2)
    types = {"blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"}
    return hf_dir_to_gguf(hf, folder / "m.gguf", "Q4_K", tensor_types=types)


def test_the_decode_stack_passes_round8_on(q4_k_m_gguf, monkeypatch):
    """A model loaded with 8-bit inputs (the default): its one-call decode stack gives the
    per-layer path's logits bit for bit, and (on a build with the kernels) not those of a load
    with NBSERVE_ROUND8=0, so the flag reaches the kernels through the stack."""
    from nbserve.cpu.kernels.build import quant_kernels

    monkeypatch.setenv("NBSERVE_ROUND16", "1")  # the same 16-bit choice for both loads
    monkeypatch.delenv("NBSERVE_ROUND8", raising=False)
    model = nbserve.load(str(q4_k_m_gguf), verbose=False).model
    monkeypatch.setenv("NBSERVE_ROUND8", "0")
    plain = nbserve.load(str(q4_k_m_gguf), verbose=False).model
    assert unfit_reason(model) is None
    want, none = _decode(model, 6, stacked=False, monkeypatch=monkeypatch)
    got, served = _decode(model, 6, stacked=True, monkeypatch=monkeypatch)
    assert none == 0 and served == 6 and _equal(got, want)
    without, _ = _decode(plain, 6, stacked=True, monkeypatch=monkeypatch)
    has_kernels = blocks_rounded8(BlockType.Q4_K, quant_kernels())
    assert _equal(got, without) != has_kernels
    if blocks_rounded(BlockType.Q4_K, quant_kernels()):  # both near the float32 answer
        for a, b in zip(got, without, strict=True):
            assert torch.allclose(a, b, rtol=0.1, atol=0.1 * float(b.abs().max()))
