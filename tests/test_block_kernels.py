"""nbserve's kernels over GGUF's own weight blocks (cpu/kernels/gguf_blocks.c, blocks.py), held
to the `gguf` package's dequantization (llama.cpp's, bit for bit) on every block type and every
code path (AVX-512 where this CPU has it, AVX2, plain C, each built with its own flags):
dequantization equal bit for bit, products equal to a float64 product of the dequantized
weights up to float32 rounding, at row counts of the row kernels and of the panels, with the
RMSNorm and the SwiGLU gate folded in; with NBQ_ROUND16, the integer row kernels' products
equal to the float64 product of the input rounded as the kernels round it; and on one real
tensor of each type of the real Gemma 3 270M Q4_K_M file where it is cached."""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from kernel_paths import NEEDS_COMPILER, PATHS

from nbserve.cpu.kernels import abi, build
from nbserve.cpu.kernels.blocks import (
    BlockType,
    block_layout,
    blocks_dequantize,
    blocks_matmul,
    blocks_rounded,
    blocks_rounded_many,
    row_bytes,
)

pytestmark = NEEDS_COMPILER
# byte offsets of each type's float16 fields (d, and dmin or m where it has one): set to sane
# scales in random blocks, whose other bytes (codes, packed sub-scales) are any bytes
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "IQ4_NL": [0], "IQ4_XS": [0]}
TYPES = list(BlockType)
K256 = [t for t in TYPES if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))][0] == 256]
K32 = [t for t in TYPES if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))][0] == 32]
ROWS = (1, 2, 3, 4, 7, 16, 33)  # up to 8: the row kernels (tiles of 4), past it: the panels
GEMMA3 = Path.home() / ".cache" / "nbserve-bench" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
_builds: dict[str, ctypes.CDLL] = {}


def _kernels(arch: list[str] | None) -> ctypes.CDLL:
    key = repr(arch)
    if key not in _builds:
        _builds[key] = build.quant_kernels(arch)
    return _builds[key]


def _random_blocks(block_type: BlockType, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of k weights as random blocks of the type: (n, row bytes) uint8."""
    elems, size = block_layout(block_type)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for offset in HALF_FIELDS[block_type.name]:
        scales = rng.uniform(0.001, 0.05, raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def _mapped(raw: np.ndarray) -> torch.Tensor:
    """The bytes of a read-only mapped tensor as a uint8 tensor, without a copy (torch warns
    once that it cannot mark it read-only; the kernels only read it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw.reshape(-1).data, dtype=torch.uint8)


def _reference(raw: np.ndarray, block_type: BlockType, n: int, k: int) -> torch.Tensor:
    """gguf's dequantization of the blocks, (n, k) float32."""
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(block_type)))
    return torch.from_numpy(np.ascontiguousarray(values.reshape(n, k), dtype=np.float32))


def _assert_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got == x @ w.T up to float32 rounding: within 1e-5 of the sum of the products' sizes
    (the kernels measured within 3e-7 of it; one wrong weight is off by far more)."""
    want = x.double() @ w.double().t()
    bound = x.double().abs() @ w.double().abs().t()
    assert got.shape == want.shape
    error = (got.double() - want).abs()
    assert bool((error <= 1e-5 * bound + 1e-30).all()), float((error / bound).max())


def test_block_types_are_ggml_type_numbers():
    """BlockType is the header's enum, and each value is ggml's (gguf's) number for its name,
    so a tensor's type from a GGUF reader converts as it is."""
    assert {f"NBQ_GGML_{t.name}": t.value for t in BlockType} == abi.ABI.enums["nbq_ggml_type"]
    for t in BlockType:
        assert gguf.GGMLQuantizationType[t.name].value == t.value
        assert block_layout(t) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.name]]


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_is_gguf_bit_for_bit(arch, block_type):
    """Every row, and rows by index (an embedding lookup, repeats and any order), are gguf's
    float32 values bit for bit."""
    lib = _kernels(arch)
    elems, _ = block_layout(block_type, lib)
    n, k = 11, elems * 3
    raw = _random_blocks(block_type, n, k, seed=int(block_type))
    blocks = torch.from_numpy(raw.reshape(-1).copy())
    want = _reference(raw, block_type, n, k)
    got = blocks_dequantize(block_type, blocks, n, k, lib=lib)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    index = torch.tensor([[10, 0, 3], [3, 7, 10]])
    got = blocks_dequantize(block_type, blocks, n, k, rows=index, lib=lib)
    assert got.shape == (2, 3, k)
    assert torch.equal(got.view(torch.int32), want[index].view(torch.int32))


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", TYPES, ids=[t.name for t in TYPES])
def test_matmul_is_the_float64_product_of_gguf_weights(arch, block_type):
    """x @ w.T over the blocks equals the float64 product of gguf's dequantized weights up to
    float32 rounding, for 1 to 33 input rows (row kernels and panels) and rows of one and of
    three blocks."""
    lib = _kernels(arch)
    elems, _ = block_layout(block_type, lib)
    g = torch.Generator().manual_seed(int(block_type))
    for blocks_a_row, n in ((1, 5), (3, 19)):
        k = elems * blocks_a_row
        raw = _random_blocks(block_type, n, k, seed=n)
        w = _reference(raw, block_type, n, k)
        blocks = torch.from_numpy(raw.reshape(-1).copy())
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g)
            _assert_product(blocks_matmul(x, block_type, blocks, n, k, lib=lib, threads=2),
                            x, w)


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", TYPES, ids=[t.name for t in TYPES])
def test_matmul_folds_in_the_norm_and_the_gate(arch, block_type):
    """With `norm`, the product of RMSNorm(x) (torch's formula); `gated`, of silu(a) * b for
    x = [a | b]: on the row kernels and on the panels."""
    lib = _kernels(arch)
    elems, _ = block_layout(block_type, lib)
    n, k, eps = 13, elems * 2, 1e-6
    raw = _random_blocks(block_type, n, k, seed=3)
    w = _reference(raw, block_type, n, k)
    blocks = torch.from_numpy(raw.reshape(-1).copy())
    g = torch.Generator().manual_seed(1)
    weight = torch.rand(k, generator=g) + 0.5
    for rows in (1, 3, 9):
        x = torch.randn(rows, k, generator=g) * 3
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        got = blocks_matmul(x, block_type, blocks, n, k, norm=weight, eps=eps, lib=lib)
        _assert_product(got, normed, w)
        gate_up = torch.randn(rows, 2 * k, generator=g)
        gated = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
        got = blocks_matmul(gate_up, block_type, blocks, n, k, gated=True, lib=lib)
        _assert_product(got, gated, w)


def _round16(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' 16-bit input (round16, matmul_common.h) as float64, and each input's bound
    on its rounding error: per group of `group` inputs (the weight type's block: 32, or 256),
    s = max |x| / 32767 and q = rint(x * (32767 / max |x|)) in float32 (ties to even, as the
    CPU's conversion), the input q s, within s / 2."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // group, group)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.round(blocks * inv)  # float32 product, then round half to even
    scale = amax / torch.tensor(32767.0)
    rounded = (q.double() * scale.double()).reshape(rows, k)
    return rounded, (scale.double() / 2).expand(-1, -1, group).reshape(rows, k)


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", TYPES, ids=[t.name for t in TYPES])
def test_round16_multiplies_the_input_rounded_to_16_bits(arch, block_type):
    """With round16, products of up to 8 rows (the row kernels) are the float64 product of the
    input rounded to 16 bits per block of the type (32 inputs, or 256 for the K-quants and
    IQ4_XS) with gguf's weights, up to float32 rounding (2e-6
    of the products' sizes; measured within 3e-7), so within the rounding's bound of the exact
    product; the inputs (one large value a block) make the exact product differ from the
    rounded one by more than that tolerance, so a kernel that ignored the flag fails here. A
    build without integer row kernels (plain C), and the panels (past 8 rows) stay exact,
    except where the build has products of many rows over built blocks, which round at any
    row count: the 256-weight types' on AVX-512 (gemm16), the 32-weight types' on AVX-512 VNNI
    and AVX2 (gemm32); past 8 rows they take prompt chunks and batches (16, 33, 129 rows: tile
    and chunk edges)."""
    lib = _kernels(arch)
    elems, _ = block_layout(block_type, lib)
    g = torch.Generator().manual_seed(int(block_type) + 100)
    for blocks_a_row, n in ((1, 7), (3, 13)):
        k = max(elems, 64) * blocks_a_row
        raw = _random_blocks(block_type, n, k, seed=n + 1)
        w = _reference(raw, block_type, n, k).double()
        blocks = torch.from_numpy(raw.reshape(-1).copy())
        most = 10**6 if blocks_rounded_many(block_type, lib) else 8  # the rows that round
        for rows in (1, 2, 3, 4, 7, 16, 33, 129):
            x = torch.randn(rows, k, generator=g)
            x[:, ::32] *= 300  # each block's step is then about 300 / 65534
            got = blocks_matmul(x, block_type, blocks, n, k, round16=True, lib=lib,
                                threads=2).double()
            if rows > most or not blocks_rounded(block_type, lib):
                _assert_product(got.float(), x, w.float())
                continue
            rounded, half_step = _round16(x, elems)
            want, exact = rounded @ w.t(), x.double() @ w.t()
            size = x.double().abs() @ w.abs().t()
            assert bool(((got - want).abs() <= 2e-6 * size).all()), \
                float(((got - want).abs() / size).max())
            assert bool(((got - exact).abs() <= half_step @ w.abs().t() + 2e-6 * size).all())
            assert bool(((exact - want).abs() > 2e-6 * size).any())  # the flag matters here


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", K256, ids=[t.name for t in K256])
def test_round16_gives_a_row_the_same_bits_in_any_batch(arch, block_type):
    """The 256-weight types' 16-bit products of many rows (gemm16: weight rows a few at a time,
    input rows in tiles, chunks by k) give each row bit for bit its product alone (the row
    kernels'), whatever the rows beside it: 1, 5, 13 and 70 rows against 7 and 11 weight rows
    (groups with a remainder), k of 1 and 12 blocks."""
    lib = _kernels(arch)
    if not blocks_rounded_many(block_type, lib):
        pytest.skip("this build rounds no more than 8 rows (AVX2, plain C)")
    g = torch.Generator().manual_seed(int(block_type) + 7)
    for k, n in ((256, 7), (3072, 11)):
        raw = _random_blocks(block_type, n, k, seed=k + n)
        blocks = torch.from_numpy(raw.reshape(-1).copy())
        for rows in (1, 5, 13, 70):
            x = torch.randn(rows, k, generator=g)
            batch = blocks_matmul(x, block_type, blocks, n, k, round16=True, lib=lib, threads=2)
            for i in range(rows):
                alone = blocks_matmul(x[i:i + 1], block_type, blocks, n, k, round16=True,
                                      lib=lib, threads=2)
                assert torch.equal(batch[i:i + 1], alone), (k, rows, i)


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("block_type", K32, ids=[t.name for t in K32])
def test_gemm32_gives_a_row_the_same_bits_in_any_batch_past_8_rows(arch, block_type):
    """The 32-weight types' 16-bit products of more than 8 rows (gemm32: 16 or 8 weight rows
    built into one lane each, input rows in tiles) give a row the same bits in any such batch
    (9, 23 and 130 rows against 7 and 19 weight rows, k of 1 and 40 blocks), and within float32
    rounding of the row kernels' product of that row alone (another float order)."""
    lib = _kernels(arch)
    if not blocks_rounded_many(block_type, lib):
        pytest.skip("this build takes the float32 panels past 8 rows (plain C)")
    g = torch.Generator().manual_seed(int(block_type) + 11)
    for k, n in ((32, 7), (1280, 19)):
        raw = _random_blocks(block_type, n, k, seed=k + n)
        w = _reference(raw, block_type, n, k).double()
        blocks = torch.from_numpy(raw.reshape(-1).copy())
        x = torch.randn(130, k, generator=g)
        many = blocks_matmul(x, block_type, blocks, n, k, round16=True, lib=lib, threads=2)
        for start, stop in ((0, 9), (100, 123), (3, 130)):
            part = blocks_matmul(x[start:stop], block_type, blocks, n, k, round16=True, lib=lib,
                                 threads=2)
            assert torch.equal(part, many[start:stop]), (k, start, stop)
        alone = torch.cat([blocks_matmul(x[i:i + 1], block_type, blocks, n, k, round16=True,
                                         lib=lib, threads=2) for i in range(0, 130, 13)])
        size = x[::13].double().abs() @ w.abs().t()
        assert bool(((many[::13].double() - alone.double()).abs() <= 2e-6 * size).all())


@pytest.mark.parametrize("block_type", [BlockType.Q4_K, BlockType.Q6_K, BlockType.Q5_0],
                         ids=["Q4_K", "Q6_K", "Q5_0"])
def test_a_weight_rounds_where_its_kernel_is_allowed_to(block_type, monkeypatch):
    """The choice is per weight, as for the other kinds: a KernelLinear over a GGUF file's
    blocks made with round16 (weights="blocks") multiplies a lone row's input rounded to 16 bits
    where the build rounds (here forced by NBSERVE_ROUND16=1; NBSERVE_ROUND8=0 keeps Q4_K's and
    Q6_K's from 8 bits), one made without (weights="blocks", exact=True) the exact input."""
    from nbserve.execution.quant import GGMLBlocks, KernelLinear

    monkeypatch.setenv("NBSERVE_ROUND16", "1")
    monkeypatch.setenv("NBSERVE_ROUND8", "0")
    lib = _kernels(None)
    elems, size = block_layout(block_type, lib)
    n, k = 9, 2 * max(elems, 64)
    raw = _random_blocks(block_type, n, k, seed=5)
    w = _reference(raw, block_type, n, k).double()
    weight = GGMLBlocks.of_file(raw.reshape(n, k // elems, size), block_type)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
    x[:, ::32] *= 300
    sizes = x.double().abs() @ w.abs().t()
    rounded = KernelLinear(weight, kernels=lib, round16=True)(x).double()
    exact = KernelLinear(weight, kernels=lib, round16=False)(x).double()
    if not blocks_rounded(block_type, lib):
        assert torch.equal(rounded, exact)
        return
    assert bool(((rounded - _round16(x, elems)[0] @ w.t()).abs() <= 2e-6 * sizes).all())
    assert bool(((exact - x.double() @ w.t()).abs() <= 2e-6 * sizes).all())
    assert not torch.equal(rounded, exact)


@pytest.mark.parametrize("arch", PATHS)
def test_round16_sums_of_the_largest_products_stay_exact(arch):
    """The 256-weight types add a block's integer products up in int32: the largest ones (Q6_K's
    scale -128 times code -32, IQ4_XS's scale -32 times value -127, every input code 32767)
    still give the exact product."""
    lib = _kernels(arch)
    n, k = 3, 512
    half = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    q6 = np.zeros((n, k // 256, 210), np.uint8)
    q6[..., 192:208] = 0x80  # int8 -128
    q6[..., 208:210] = half
    iq4 = np.zeros((n, k // 256, 136), np.uint8)  # scales 0 (-32), codes 0 (-127)
    iq4[..., 0:2] = half
    x = torch.ones(1, k)
    for block_type, blocks3 in ((BlockType.Q6_K, q6), (BlockType.IQ4_XS, iq4)):
        raw = blocks3.reshape(n, -1)
        w = _reference(raw, block_type, n, k).double()
        blocks = torch.from_numpy(raw.reshape(-1).copy())
        got = blocks_matmul(x, block_type, blocks, n, k, round16=True, lib=lib).double()
        assert torch.allclose(got, x.double() @ w.t(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", PATHS)
def test_round16_is_served_where_the_build_has_integer_kernels(arch):
    """Every served type has integer row kernels on the AVX2 and AVX-512 builds, none on the
    plain C one (which keeps float32 inputs)."""
    lib = _kernels(arch)
    rounded = {t.name for t in TYPES if blocks_rounded(t, lib)}
    assert rounded == (set() if lib.nbq_simd_width() == 1 else {t.name for t in TYPES})


def test_what_is_not_served_is_refused_by_name():
    """A type without kernels, a row that is not whole blocks, blocks of the wrong size and an
    index outside the rows are errors that say so (the C side answers -2 for each)."""
    lib = _kernels(None)
    blocks = torch.from_numpy(_random_blocks(BlockType.Q4_K, 2, 256, seed=0).reshape(-1).copy())
    with pytest.raises(ValueError, match=r"IQ2_XXS.*not served.*Q4_K"):
        block_layout(gguf.GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(ValueError, match="multiple of 256 weights, got 320"):
        row_bytes(BlockType.Q4_K, 320)
    with pytest.raises(ValueError, match="288 bytes"):
        blocks_matmul(torch.randn(1, 256), BlockType.Q4_K, blocks[:-1], 2, 256)
    with pytest.raises(IndexError, match="0..1"):
        blocks_dequantize(BlockType.Q4_K, blocks, 2, 256, rows=torch.tensor([2]))
    y = torch.empty(2)
    x = torch.randn(256)
    assert lib.nbq_blocks_supported(int(gguf.GGMLQuantizationType.IQ2_XXS)) == 0
    assert lib.nbq_blocks_matmul(x.data_ptr(), 1, 256, 16, blocks.data_ptr(), 2, y.data_ptr(),
                                 1, None, 0.0, 0) == -2
    assert lib.nbq_blocks_matmul(x.data_ptr(), 1, 128, 12, blocks.data_ptr(), 2, y.data_ptr(),
                                 1, None, 0.0, 0) == -2
    index = torch.tensor([0, 2], dtype=torch.int32)
    out = torch.empty(2, 256)
    assert lib.nbq_blocks_dequantize(12, blocks.data_ptr(), 2, 256, index.data_ptr(), 2,
                                     out.data_ptr(), 1) == -2


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA3.is_file(), reason=f"the real Gemma 3 270M file is not cached at "
                    f"{GEMMA3} (python benchmarks/real_models.py fetches it)")
@pytest.mark.parametrize("arch", PATHS)
def test_real_gemma3_tensors_of_every_type(arch):
    """One real tensor of each block type in the Gemma 3 270M Q4_K_M file (Q4_K, Q5_0, Q6_K,
    Q8_0), multiplied from the file's mapped bytes where they lie, at 1, 2 and 9 rows, against
    gguf's dequantization; and token embeddings looked up from their blocks."""
    lib = _kernels(arch)
    reader = gguf.GGUFReader(GEMMA3)
    smallest: dict[int, gguf.ReaderTensor] = {}
    for tensor in reader.tensors:
        kind = int(tensor.tensor_type)
        if kind in BlockType._value2member_map_ and len(tensor.shape) == 2 and \
                (kind not in smallest or tensor.n_bytes < smallest[kind].n_bytes):
            smallest[kind] = tensor
    assert {BlockType(t).name for t in smallest} >= {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    g = torch.Generator().manual_seed(0)
    for kind, tensor in smallest.items():
        k, n = (int(v) for v in tensor.shape)  # GGUF lists the fastest dimension first
        raw = np.asarray(tensor.data)
        w = _reference(raw, BlockType(kind), n, k)
        blocks = _mapped(raw)
        for rows in (1, 2, 9):
            x = torch.randn(rows, k, generator=g)
            _assert_product(blocks_matmul(x, kind, blocks, n, k, lib=lib), x, w)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    k, n = (int(v) for v in embd.shape)
    raw = np.asarray(embd.data)
    ids = torch.tensor([0, 2, 105, n - 1, 2])
    want = _reference(raw[ids.numpy()], BlockType(int(embd.tensor_type)), len(ids), k)
    blocks = _mapped(raw)
    got = blocks_dequantize(int(embd.tensor_type), blocks, n, k, rows=ids, lib=lib)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
