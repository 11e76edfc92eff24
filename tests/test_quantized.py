"""weights="blocks": matmuls of any row count over 4/8-bit blocks, through nbserve's C kernel
(row kernels for a few rows, panels of dequantized weight rows for more).

The kernel is checked against a float64 product on every code path it has (AVX-512 where this
CPU has it, AVX2, plain C: each built with its own compiler flags); the loaders are checked to
multiply a GGUF's own blocks (not a requantization), and the model to give float32's logits up
to rounding.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from gguf_util import hf_dir_to_gguf
from kernel_paths import NEEDS_COMPILER, PATHS, X86
from tiny_models import make_tiny_hf_dir

import nbserve
from nbserve.cpu.kernels import build
from nbserve.cpu.kernels.tuning import round16_pays
from nbserve.execution.formats import BlockForm, Float32Form
from nbserve.execution.quant import KernelLinear, QuantBlocks
from nbserve.execution.weights import count_parameters

pytestmark = NEEDS_COMPILER
WIDTH = {"avx2": 8, "plain-c": 1}


def _random_blocks(kind: str, rows: int, k: int, seed: int = 0) -> QuantBlocks:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(rows, k // 32, generator=g) * 0.1 + 0.01
    if kind == "q8":
        codes = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
        return QuantBlocks("q8", codes, scales, None)
    codes = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    return QuantBlocks("q4", codes, scales, -torch.rand(rows, k // 32, generator=g) * 0.5)


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_kernel_equals_a_float64_product_on_every_path(arch, kind, request):
    kernels = build.quant_kernels(arch)
    path = request.node.callspec.id.split("-", 1)[1] if arch is not None else "native"
    if path in WIDTH:
        assert kernels.nbq_simd_width() == WIDTH[path]  # the path meant to run is the one built
    for rows, k, n in [(1, 64, 7), (2, 96, 33), (3, 576, 50), (4, 160, 9), (9, 128, 17),
                       (16, 576, 70), (37, 96, 33)]:  # past 3 rows: the panels
        blocks = _random_blocks(kind, n, k, seed=rows)  # 96 and 160: an odd number of blocks
        # seeded: an unseeded input once summed 576 products to 1.3e-4 off (float32's order
        # of sums against float64's), past atol, in 1 of 1120 outputs
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = (x.double() @ blocks.dequantize().double().t()).float()
        got = KernelLinear(blocks, kernels=kernels)(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", PATHS)
def test_kernel_folds_in_the_norm_and_the_gate(arch):
    from nbserve.models.layers import RMSNorm

    kernels = build.quant_kernels(arch)
    blocks = _random_blocks("q4", 24, 96)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.rand(96) + 0.5
    w = blocks.dequantize().double()
    q = KernelLinear(blocks, kernels=kernels)
    for rows in (1, 5):
        x = torch.randn(rows, 96) * 3
        with torch.no_grad():
            want = (norm(x).double() @ w.t()).float()
        torch.testing.assert_close(q(x, norm=norm), want, rtol=1e-5, atol=1e-4)
        gate_up = torch.randn(rows, 1, 192)
        want = (torch.nn.functional.silu(gate_up[..., :96]) * gate_up[..., 96:]).double() @ w.t()
        torch.testing.assert_close(q(gate_up, gated=True), want.float(), rtol=1e-5, atol=1e-4)


def _rounded16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, k) as the kernel rounds it per block of 32 (float32 arithmetic, ties to even):
    codes round(x * (32767 / max |x|)) and scales max |x| / 32767, (rows, k / 32, 32) and
    (rows, k / 32, 1)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    return torch.round(blocks * inverse), amax / torch.tensor(32767.0)


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_round16_multiplies_the_input_rounded_to_16_bits(arch, kind, monkeypatch):
    """round16: where the build has the integer row kernels (AVX2 and AVX-512; taken there
    whatever the AVX-512 machine measures, see test_tuning), steps of up to
    nbq_round16_max_rows rows multiply each block of the input rounded to 16 bits (q4's
    m terms from the float32 input's block sums): the float64 product of those rounded inputs,
    up to float32 accumulation, and within max |x| / 65534 an input of the exact product.
    Larger steps, and builds without those kernels, give the exact kernel's bits."""
    monkeypatch.setenv("NBSERVE_ROUND16", "1")
    kernels = build.quant_kernels(arch)
    most = kernels.nbq_round16_max_rows()
    if (arch is not None and "-mavx2" in arch) or kernels.nbq_simd_width() == 16:
        assert most == 2  # the AVX2 and AVX-512 paths have them
    for rows, k, n in [(1, 96, 9), (2, 576, 50), (1, 320, 33), (2, 1536, 12), (3, 576, 20),
                       (9, 160, 17)]:  # 3, 18, 10, 48 blocks: groups of 8 and the rest
        blocks = _random_blocks(kind, n, k, seed=rows + k)
        x = torch.randn(rows, k) * torch.logspace(-2, 1, k)  # blocks of different ranges
        x[0, 5] = 0.0
        if k >= 64:
            x[-1, 32:64] = 0.0  # a block of zeros: scale 0
        exact = KernelLinear(blocks, kernels=kernels)(x)
        got = KernelLinear(blocks, kernels=kernels, round16=True)(x)
        if rows > most:
            assert torch.equal(got, exact), (rows, k)
            continue
        codes, scales = _rounded16(x)
        w = blocks.dequantize().double().reshape(n, -1, 32)
        d = blocks.scales.double()[..., None]
        m = torch.zeros_like(d) if blocks.mins is None else blocks.mins.double()[..., None]
        q = (w - m) / d  # the weight codes, exactly
        products = torch.einsum("rbj,nbj->rnb", codes.double(), q) * \
            scales.double()[..., 0][:, None]
        sums = x.double().reshape(rows, -1, 32).sum(-1)
        want = (products * d[..., 0]).sum(-1) + sums @ m[..., 0].t()
        scale = x.double().abs() @ blocks.dequantize().double().abs().t()  # float32's noise
        assert ((got.double() - want).abs() <= 1e-6 * scale).all()
        assert ((exact.double() - want).abs() > 1e-6 * scale).any()  # the rounding shows
        bound = (blocks.dequantize().double().abs() @ (scales.double()[..., 0] / 2)
                 .repeat_interleave(32, dim=1).t()).t()
        assert ((got.double() - x.double() @ blocks.dequantize().double().t()).abs()
                <= bound + 1e-4).all()


def test_q4_dequantize_follows_the_gguf_nibble_order():
    low, high = torch.arange(16, dtype=torch.uint8), torch.arange(15, -1, -1, dtype=torch.uint8)
    codes = (low | (high << 4)).view(1, 16)
    blocks = QuantBlocks("q4", codes, torch.tensor([[2.0]]), torch.tensor([[-1.0]]))
    w = blocks.dequantize()[0]
    assert w[:16].tolist() == [2.0 * i - 1 for i in range(16)]  # low nibbles: weights 0-15
    assert w[16:].tolist() == [2.0 * (15 - i) - 1 for i in range(16)]  # high: 16-31


# Q8_0 codes are rounded with the float32 scale, which is then stored as float16 (llama.cpp's
# way): half a step, plus up to 127 codes times the scale's float16 rounding (2^-11 of it)
Q8_STEPS = 0.5 + 127 * 2 ** -11


def test_q8_0_from_float_is_within_half_a_step():
    w = torch.randn(5, 96) * torch.logspace(-3, 1, 96)
    blocks = QuantBlocks.from_float(w)
    assert blocks.kind == "q8" and blocks.shape == (5, 96) and blocks.scales.dtype == \
        torch.float16
    step = blocks.scales.float().repeat_interleave(32, dim=1)
    assert ((blocks.dequantize() - w).abs() <= step * Q8_STEPS + 1e-7).all()
    assert QuantBlocks.from_float(torch.randn(4, 48)) is None  # rows not made of whole blocks
    assert QuantBlocks.from_float(torch.zeros(2, 32)).dequantize().abs().sum() == 0


@pytest.mark.skipif(not X86, reason="x86 only")
@pytest.mark.parametrize("kind", ["q4", "q8", "f32"])
def test_the_panels_give_the_same_bits_in_16_lanes_as_in_8(kind):
    """The panels' vectors hold 16 input rows with AVX-512, 8 with AVX2: each lane sums its
    own row in the same order, so the two builds agree bit for bit (where the CPU has
    AVX-512; elsewhere both builds are the AVX2 one and the test shows nothing)."""
    native, avx2 = build.quant_kernels(), build.quant_kernels(["-mavx2", "-mfma", "-mf16c"])
    weight = _random_blocks(kind if kind != "f32" else "q4", 75, 160, seed=5)
    if kind == "f32":
        weight = weight.dequantize()
    x = torch.randn(41, 160)  # two tiles of 16 (or five of 8) and a part tile
    a, b = KernelLinear(weight, kernels=native)(x), KernelLinear(weight, kernels=avx2)(x)
    assert x.shape[0] > native.nbq_row_path_max() and torch.equal(a, b)


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_a_rows_product_does_not_depend_on_the_other_rows(arch, kind):
    """Within the row kernels (up to nbq_row_path_max rows) and within the panels (more), a
    row gets the same bits whatever else the step holds (each row sums in one order in every
    tile), so batching does not change an answer; the two paths agree to rounding."""
    kernels = build.quant_kernels(arch)
    most = kernels.nbq_row_path_max()
    blocks = _random_blocks(kind, 75, 160, seed=3)
    linear = KernelLinear(blocks, kernels=kernels)
    x = torch.randn(4 * most + 7, 160)
    whole = linear(x)  # the panels
    for start, stop in [(0, most + 1), (5, 2 * most + 3), (most, 4 * most + 7), (3, 3 * most)]:
        assert torch.equal(linear(x[start:stop]), whole[start:stop]), (start, stop)
    rows = linear(x[:most])  # the row kernels
    for start, stop in [(0, 1), (1, 3), (2, most)]:
        assert torch.equal(linear(x[start:stop]), rows[start:stop]), (start, stop)
    torch.testing.assert_close(rows, whole[:most], rtol=1e-5, atol=1e-4)


def test_kernel_applies_to_float32_cpu_rows_of_any_count():
    q = KernelLinear(_random_blocks("q8", 8, 32), bias=torch.ones(8))
    assert q.serves_every_step and q.max_rows is None
    assert q.applies(torch.randn(1, 32)) and q.applies(torch.randn(300, 1, 32))
    assert not q.applies(torch.randn(1, 32).double())
    f = KernelLinear(torch.randn(8, 32))  # the float32 kernel: a few rows only
    assert not f.serves_every_step and not f.applies(torch.randn(f.max_rows + 1, 32))
    x = torch.randn(2, 1, 32)
    torch.testing.assert_close(q(x), x @ q.weight.dequantize().t() + 1, rtol=1e-5, atol=1e-5)


def _gguf(hf_dir, folder, **types: str):
    """The tiny llama (tied head) as a GGUF: Q4_1 layers, a Q4_0 down_proj, a Q8_0 embedding,
    and `types` (GGUF name with "." as "__": type) on top."""
    types = {"token_embd.weight": "Q8_0", "blk.0.ffn_down.weight": "Q4_0",
             **{name.replace("__", "."): t for name, t in types.items()}}
    return hf_dir_to_gguf(hf_dir, folder / "m.gguf", "Q4_1", tensor_types=types)


@pytest.fixture(scope="module")
def q4_gguf(tiny_llama_dir, tmp_path_factory):
    return _gguf(tiny_llama_dir, tmp_path_factory.mktemp("q4"))


def _lone_steps(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits of every prompt token, logits of one decode step after it)."""
    cache = model.make_cache(1, 64)
    pre = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]),
                        cache)[0]
    one = model.forward(torch.tensor([[ids[-1]]]), torch.tensor([[len(ids)]]),
                        torch.tensor([0]), cache, contiguous_from=0)[0, -1]
    return pre, one


def test_a_gguf_is_multiplied_by_its_own_blocks(q4_gguf, monkeypatch):
    full = nbserve.load(str(q4_gguf), dtype="float32", verbose=False).model  # the float kernel
    model = nbserve.load(str(q4_gguf), weights="blocks", exact=True, verbose=False).model
    rounded = nbserve.load(str(q4_gguf), weights="blocks", verbose=False).model
    monkeypatch.setenv("NBSERVE_KERNELS", "0")
    plain = nbserve.load(str(q4_gguf), verbose=False).model  # float32 without the C kernel
    assert model.weight_format == "quantized-exact" and full.weight_format == "float32"
    assert rounded.weight_format == "quantized"
    holders = model._named_holders()
    kinds = [holder.form.kernel.kind for holder, _ in holders]
    assert kinds == ["q4"] * (len(holders) - 1) + ["q8"]  # the tied head: the Q8_0 embedding
    # exactly the float32 model's (dequantized) weights: the file's own blocks, Q/K rows
    # unpermuted, Q4_0 = Q4_1, m = -8 d (the quantized model keeps no float32 weight to compare)
    for (holder, names), (dense, _) in zip(holders, full._named_holders()):
        assert torch.equal(holder.form.kernel.weight.dequantize(), dense.weight), names
    ids = [3, 17, 5, 9, 11, 2] * 3
    pre_f, (pre_q, one_q) = _lone_steps(full, ids)[0], _lone_steps(model, ids)
    pre_p, one_p = _lone_steps(plain, ids)
    assert torch.equal(pre_f, pre_p)  # 18 rows of the float32 model: oneDNN either way
    for got, want in ((pre_q, pre_p), (one_q, one_p)):  # 18 rows: the panels; 1: a row kernel
        assert not torch.equal(got, want)  # the blocks ran, in another summation order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not any(h.form.kernel.round16 for h in model._weight_holders())
    assert all(h.form.kernel.round16 for h in rounded._weight_holders())  # weights="blocks"
    pre_r, one_r = _lone_steps(rounded, ids)
    assert torch.equal(pre_r, pre_q)  # 18 rows: the panels, never rounded
    if round16_pays(build.quant_kernels()):  # a lone row: its input rounded
        assert not torch.equal(one_r, one_q)
        assert ((one_r - one_p).norm() / one_p.norm()).item() < 1e-3
    else:
        assert torch.equal(one_r, one_q)
    if build.quant_kernels().nbq_simd_width() == 16:  # AVX-512 rebuilds the float32 weights
        # exactly and sums as the float kernel: lossless in the row kernels (two lone steps;
        # a prefill of 18 rows runs on the panels here and on oneDNN for float32)
        for got, want in zip(_lone_steps(model, ids[:1]), _lone_steps(full, ids[:1])):
            assert torch.equal(got, want)


def test_a_gguf_of_q4_q8_blocks_keeps_them_by_default_on_cpu(q4_gguf, tiny_llama_dir, tmp_path,
                                                              monkeypatch):
    from nbserve.execution.linear import packing_available

    default = nbserve.load(str(q4_gguf), verbose=False).model  # dtype=None
    assert default.weight_format == "quantized"  # lossless for these types: the file's blocks
    assert {h.form.kernel.kind for h in default._weight_holders()} == {"q4", "q8"}
    # built without the float32 model's copies (packed, transposed head): never made at all
    assert default._head_t is None and not default._wants["packed"]
    f16 = _gguf(tiny_llama_dir, tmp_path, blk__1__attn_v__weight="F16")
    mixed = nbserve.load(str(f16), verbose=False).model  # any quantized file: its blocks
    assert mixed.weight_format == "quantized"  # (the F16 v's fused q/k/v: Q8_0 made of it)
    assert mixed._named_holders()[4][0].form.kernel.weight.kind == "q8"
    assert nbserve.load(str(f16), dtype="float32", verbose=False).model.weight_format == \
        "float32"  # float32 when asked
    as_built = nbserve.load(str(tiny_llama_dir), verbose=False).model
    assert as_built.weight_format == "float32"
    packed = [isinstance(h.form, Float32Form) and h.form.packed is not None
              for h in as_built._weight_holders()]
    assert all(packed) if packing_available(as_built.lm_head.weight) else \
        as_built._head_t is not None
    monkeypatch.setenv("NBSERVE_KERNELS", "0")
    assert nbserve.load(str(q4_gguf), verbose=False).model.weight_format == "float32"


def test_a_fused_projection_with_other_types_gets_q8_0_made_at_load(tiny_llama_dir, tmp_path):
    path = _gguf(tiny_llama_dir, tmp_path, blk__1__attn_v__weight="F16")
    model = nbserve.load(str(path), weights="blocks", verbose=False).model
    holder, names = model._named_holders()[4]
    assert names[2] == "model.layers.1.self_attn.v_proj.weight"
    blocks = holder.form.kernel.weight  # Q4_1 q/k and an F16 v: one Q8_0 made from the floats
    assert blocks.kind == "q8" and model._named_holders()[3][0].form.kernel.weight.kind == "q4"
    step = blocks.scales.float().repeat_interleave(32, dim=1)
    model.restore_dense_weights()  # quantized keeps them in the packed copies only
    assert ((blocks.dequantize() - holder.weight).abs() <= step * Q8_STEPS + 1e-7).all()


def test_a_float_checkpoint_gets_q8_0_copies(tiny_llama_dir):
    full = nbserve.load(str(tiny_llama_dir), verbose=False).model
    model = nbserve.load(str(tiny_llama_dir), weights="blocks", verbose=False).model
    assert {h.form.kernel.weight.kind for h in model._weight_holders()} == {"q8"}
    ids = [3, 17, 5, 9, 11, 2]
    (_, one_f), (_, one_q) = _lone_steps(full, ids), _lone_steps(model, ids)
    error = ((one_q - one_f).norm() / one_f.norm()).item()
    assert 0 < error < 0.03, error  # Q8_0 weights (0.2-0.4% each) through 2 random layers
    n_full, bytes_full = nbserve.execution.weights.count_parameters(full)
    n_q, bytes_q = nbserve.execution.weights.count_parameters(model)
    assert n_q == n_full and bytes_q > 4 * n_q  # the copies are counted
    assert bytes_q < bytes_full  # no packed copies: the blocks serve every step
    # Q8_0 made here is not the weights' exact values: the float32 weights stay, to restore
    assert not model.dense_released and all(isinstance(h.form, BlockForm)
                                                  for h in model._weight_holders())


def test_moving_or_copying_the_model_keeps_the_copies_right(q4_gguf):
    model = nbserve.load(str(q4_gguf), weights="blocks", verbose=False).model
    ids = [3, 17, 5]
    _, before = _lone_steps(model, ids)
    model.to(torch.float64)
    assert model.weight_format == "float64"
    # float64 rows: no kernel
    assert all(h.form is None or h.form.kernel is None for h in model._weight_holders())
    model.to(torch.float32)
    assert model.weight_format == "quantized"
    assert torch.equal(_lone_steps(model, ids)[1], before)
    twin = copy.deepcopy(model)  # a replica: its own blocks, its own pointers
    assert twin.lm_head.form.kernel.weight.codes.data_ptr() != \
        model.lm_head.form.kernel.weight.codes.data_ptr()
    assert torch.equal(_lone_steps(twin, ids)[1], before)


def test_without_a_compiler_the_error_says_what_to_do(tiny_llama_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("NBSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", None)
    with pytest.raises(build.KernelBuildError, match="apt install gcc.*weights='mixed16'"):
        nbserve.load(str(tiny_llama_dir), weights="blocks", verbose=False)
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\n"
                       "echo 'fatal: no such target' >&2; exit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(build.KernelBuildError, match="no such target"):
        build.quant_kernels()
    # gcc removes its output when it fails: the compiler's own message still reaches the user
    removing = tmp_path / "removing-cc"
    removing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\n"
                        "while [ $# -gt 0 ]; do [ \"$1\" = -o ] && rm -f \"$2\"; shift; done\n"
                        "echo 'error: unknown type name' >&2; exit 1\n")
    removing.chmod(0o755)
    monkeypatch.setenv("CC", str(removing))
    with pytest.raises(build.KernelBuildError, match="unknown type name"):
        build.quant_kernels()


def test_quantized_needs_a_cpu_float32_model(tiny_llama_dir):
    model = nbserve.load(str(tiny_llama_dir), dtype="bfloat16", verbose=False).model
    with pytest.raises(ValueError, match="CPU float32 option"):
        model.use_quantized_weights()
    with pytest.raises(ValueError, match="applies to checkpoints nbserve loads itself"):
        nbserve.load(torch.nn.Linear(2, 2), weights="blocks")


@pytest.mark.slow
def test_default_model_keeps_its_answer_quantized(default_loaded):
    loaded = default_loaded  # the GGUF's Q4_1/Q8_0 blocks: dtype "quantized" by default
    assert {h.form.kernel.weight.kind for h in loaded.model._weight_holders()} == {"q4", "q8"}
    with nbserve.Engine(loaded, max_batch=2, max_context=256, quiet=True) as engine:
        answer = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                             max_tokens=16, temperature=0)
    assert answer == "The capital of France is Paris."


def test_an_unwritable_cache_falls_back_with_a_warning(tiny_llama_dir, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("NBSERVE_CACHE", str(blocker / "cache"))  # mkdir fails (even as root)
    monkeypatch.setattr(build, "_loaded", None)
    with pytest.warns(RuntimeWarning, match="NBSERVE_CACHE"):
        model = nbserve.load(str(tiny_llama_dir), verbose=False).model  # float32: no kernel
    assert all(h.form is None or h.form.kernel is None for h in model._weight_holders())
    ids = torch.tensor([[3, 17, 5]])
    assert model.forward(ids, torch.arange(3)[None], torch.tensor([0]),
                         model.make_cache(1, 8)).isfinite().all()
    with pytest.raises(build.KernelBuildError, match="NBSERVE_CACHE"):
        nbserve.load(str(tiny_llama_dir), weights="blocks", verbose=False)


@pytest.mark.parametrize("isa, width", [pytest.param("avx2", 8, marks=pytest.mark.skipif(
    not X86, reason="x86 only")), ("plain", 1)])
def test_the_kernel_path_can_be_forced(tmp_path, isa, width):
    """NBSERVE_KERNEL_ISA=avx2 builds the AVX2 path on any x86 CPU (AVX-512 ones included), so
    one machine measures what an AVX2-only laptop runs; a fresh process, as the default build
    is loaded once per process."""
    env = {**os.environ, "NBSERVE_KERNEL_ISA": isa, "NBSERVE_CACHE": str(tmp_path)}
    code = ("from nbserve.cpu.kernels.build import quant_kernels; "
            "print(quant_kernels().nbq_simd_width())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip() == str(width)


def test_an_unknown_kernel_path_is_named(tmp_path):
    env = {**os.environ, "NBSERVE_KERNEL_ISA": "avx9000", "NBSERVE_CACHE": str(tmp_path)}
    code = "from nbserve.cpu.kernels.build import quant_kernels; quant_kernels()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "NBSERVE_KERNEL_ISA='avx9000' is not one of" in out.stderr


def test_quantized_keeps_no_float32_copy_of_a_matmul_weight(q4_gguf, monkeypatch):
    """The quantized blocks serve steps of every size: no packed copy is kept, the plain
    float32 weights are dropped (on meta, restorable from the blocks bit for bit), the parsed
    file is not kept, and every output stays the same bit for bit."""
    from nbserve.loading import gguf

    model = nbserve.load(str(q4_gguf), verbose=False).model  # a lossless GGUF: quantized
    assert model.weight_format == "quantized" and model.dense_released
    assert gguf._reader.cache_info().currsize == 0  # no parsed file (fields, memory map) kept
    for holder, names in model._named_holders():  # the tied head's too: the embedding
        assert holder.form.serves_every_step and isinstance(holder.form, BlockForm), names
        assert holder.weight.device.type == "meta", names
        assert all(model.get_parameter(n).device.type == "meta" for n in names), names
    assert model.lm_head.weight is model.embedding_weight()  # still one tied parameter
    real = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    assert all(n.endswith(("norm.weight", ".bias")) for n in real), real
    assert model.device.type == "cpu" and model.dtype == torch.float32  # read off the norms
    walks = []  # asked several times a step: the parameters are walked once, not each time
    real_parameters = type(model).parameters
    monkeypatch.setattr(type(model), "parameters",
                        lambda self, *a, **k: walks.append(1) or real_parameters(self, *a, **k))
    for _ in range(5):
        assert model.device.type == "cpu" and model.dtype == torch.float32
    assert len(walks) <= 1
    monkeypatch.undo()
    blocks = sum(holder.form.kernel.nbytes for holder, _ in model._named_holders())
    assert model.derived_bytes() == blocks  # the blocks and nothing else
    kept = nbserve.load(str(q4_gguf), dtype="float32", verbose=False).model
    kept.use_quantized_weights(gguf.read_quant_blocks(q4_gguf))  # the blocks beside floats
    assert not kept.dense_released
    assert count_parameters(model)[0] == count_parameters(kept)[0]
    assert count_parameters(model)[1] < count_parameters(kept)[1]  # the copies are counted
    ids = [3, 17, 5, 9, 11, 2] * 3
    for a, b in zip(_lone_steps(model, ids), _lone_steps(kept, ids)):  # 18 rows, 1 row
        assert torch.equal(a, b)
    for rows in (3, 4, 13):  # decode batches on either side of the row kernels
        x = torch.tensor([ids[:rows]]).t()
        steps = [m.forward(x, torch.zeros(rows, 1, dtype=torch.long), torch.arange(rows),
                           m.make_cache(rows, 8), contiguous_from=0) for m in (model, kept)]
        assert torch.equal(*steps), rows
    state, want = model.state_dict(), kept.state_dict()  # values read back, still released
    assert model.dense_released and state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k]) for k in want)
    model.to(torch.float64)  # a move brings the weights back, a float32 CPU model drops them
    assert not model.dense_released and model.model.layers[0].mlp.down_proj.weight.dtype == \
        torch.float64
    model.to(torch.float32)
    assert model.dense_released
    assert torch.equal(_lone_steps(model, ids)[0], _lone_steps(kept, ids)[0])
    model.restore_dense_weights()
    for (holder, _), (twin, _) in zip(model._named_holders(), kept._named_holders()):
        assert torch.equal(holder.weight, twin.weight)  # bit for bit, out of the blocks


@pytest.mark.parametrize("tie", [True, False])
def test_the_embedding_is_looked_up_in_its_blocks(tmp_path, tie):
    """A GGUF's own embedding blocks stand for the float32 embedding (dropped, on meta):
    lookups dequantize the rows they need, the same values bit for bit; a tied head stays
    tied to it; an untied embedding's blocks are counted as the model's bytes; the weight
    comes back for state_dict and moves."""
    hf = make_tiny_hf_dir(tmp_path / "hf", "llama", tie=tie)
    path = _gguf(hf, tmp_path)
    model = nbserve.load(str(path), verbose=False).model
    with_weight = nbserve.load(str(path), verbose=False).model
    with_weight.restore_dense_weights()  # the float32 embedding, as loaded from the file
    assert model.embedding_weight().device.type == "meta" and model.dense_released
    assert (model.lm_head.weight is model.embedding_weight()) == tie
    ids = torch.tensor([[3, 17, 5], [9, 0, model.vocab_size - 1]])
    want = torch.nn.functional.embedding(ids, with_weight.embedding_weight())
    assert torch.equal(model.embed(ids), want) and model.embed(ids).shape == (2, 3, 64)
    head = model.lm_head.form.kernel.weight
    blocks = sum(h.form.kernel.nbytes for h, _ in model._named_holders())
    extra = 0 if tie else model._embedding_blocks.nbytes
    assert tie == (model._embedding_blocks is head) and model.derived_bytes() == blocks + extra
    assert count_parameters(model)[1] < count_parameters(with_weight)[1]
    from nbserve.loading import LoadedModel, summary_line

    line = summary_line(LoadedModel(model=model, tokenizer=None, template=None, name="m"), 1.0)
    total = count_parameters(model)[1]
    assert f"{total / 2**20:.0f} MiB of weights, {model.derived_bytes() / 2**20:.0f} MiB of " \
        "them quantized blocks" in line, line
    for a, b in zip(_lone_steps(model, [3, 17, 5, 9]), _lone_steps(with_weight, [3, 17, 5, 9])):
        assert torch.equal(a, b)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"],
                       with_weight.embedding_weight())
    assert model.embedding_weight().device.type == "meta"  # released again after state_dict
    model.restore_dense_weights()
    assert torch.equal(model.embedding_weight(), with_weight.embedding_weight())
    assert (model.lm_head.weight is model.embedding_weight()) == tie


def test_loading_and_decoding_import_no_compiler_stack(q4_gguf):
    """Building the model on meta must not run torch's random init there: its meta version
    imports torch._dynamo, which costs seconds at load and tens of MB of resident memory for
    the life of the process. A fresh process,
    as anything imported before would hide it."""
    code = ("import sys, torch, nbserve\n"
            f"m = nbserve.load({str(q4_gguf)!r}, verbose=False).model\n"
            "cache = m.make_cache(1, 16)\n"
            "m.forward(torch.tensor([[3, 4, 5]]), torch.arange(3)[None], torch.tensor([0]), "
            "cache)\n"
            "print(sorted(n for n in sys.modules if n.startswith(('torch._dynamo', "
            "'torch._inductor', 'torch.distributed.tensor'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_quantized_model_caches_float16_unless_told(q4_gguf, tiny_llama_dir):
    """The engine's paged cache takes the model's `default_kv_dtype`: float16 for a quantized
    CPU model (its attention runs in the C kernels), the model's dtype otherwise; `kv_dtype`
    overrides it, and the budget is sized in the dtype chosen."""
    from nbserve.engine import Engine

    quantized = nbserve.load(str(q4_gguf), verbose=False)
    plain = nbserve.load(str(tiny_llama_dir), verbose=False)
    assert quantized.model.default_kv_dtype == torch.float16
    assert plain.model.default_kv_dtype == torch.float32
    budget = 8 * 32 * quantized.model.kv_bytes_per_token(torch.float32)  # 8 float32 blocks
    blocks = {}
    for loaded, kv_dtype, want in ((quantized, None, torch.float16),
                                   (quantized, "float32", torch.float32),
                                   (plain, None, torch.float32)):
        with Engine(loaded, max_batch=4, max_context=512, kv_memory=budget, quiet=True,
                    kv_dtype=kv_dtype) as engine:
            assert engine.cache.dtype == want
            blocks[loaded is plain, want] = engine.stats()["kv_blocks_total"]
    assert quantized.model.kv_bytes_per_token() * 2 == plain.model.kv_bytes_per_token()
    assert blocks[False, torch.float16] >= 2 * blocks[False, torch.float32] - 1  # twice the room
    assert blocks[True, torch.float32] == blocks[False, torch.float32]
