"""nbserve.engine.sampling: per-row semantics inside one batch, seeds, logprobs, plus a timing
print."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nbserve.engine import sampling
from nbserve.engine.sampling import SeqSampler, _top_k_, _top_p_sorted_, process_logits, sample
from nbserve.types import SamplingParams

V = 100


def make(n: int = 1, prompt: list[int] | None = None, offset: int = 0, **kw) -> list[SeqSampler]:
    return [SeqSampler.create(SamplingParams(**kw), prompt or [], "cpu", offset) for _ in range(n)]


def draws(logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """n unseeded draws from one row of logits (V,), in a single batch -> (n,) ids."""
    torch.manual_seed(1234)
    return torch.tensor(sample(logits.expand(n, -1), make(n, **kw)).token_ids)


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic with bins of expected count < 5 pooled -> (statistic, degrees of
    freedom)."""
    obs = torch.bincount(ids, minlength=probs.numel()).double()
    exp = probs.double() * ids.numel()
    small = exp < 5
    o = torch.cat([obs[~small], obs[small].sum()[None]])
    e = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = e > 0
    return float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


def nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Reference top-p: the smallest most-probable prefix whose mass reaches p."""
    sp, si = probs.sort(descending=True)
    n = int((sp.cumsum(0) < p).sum()) + 1
    return set(si[:n].tolist())


def test_greedy_is_argmax_and_logits_untouched():
    logits = torch.randn(8, V)
    before = logits.clone()
    assert sample(logits, make(8, temperature=0)).token_ids == logits.argmax(-1).tolist()
    # Greedy rows mixed with sampled, biased and penalised rows stay argmax of their own row.
    ss = (
        make(2, temperature=0)
        + make(2)
        + make(2, temperature=0, prompt=[1], repetition_penalty=1.5)
    )
    ss += make(2, logit_bias={5: 1.0}, top_p=0.5)
    out = sample(logits, ss)
    assert out.token_ids[:2] == logits[:2].argmax(-1).tolist()
    assert out.token_ids[4:6] == process_logits(logits, ss)[4:6].argmax(-1).tolist()
    for kw in ({}, {"top_k": 5, "top_p": 0.5, "min_p": 0.1}, {"top_p": 0.3}):  # in-place paths
        sample(logits, make(8, **kw))
    assert torch.equal(logits, before)
    # Half-precision logits: greedy and sampled rows both work (computed in float32).
    half = logits.bfloat16()
    out = sample(half, make(4, temperature=0) + make(4, top_p=0.9, logprobs=True))
    assert out.token_ids[:4] == half[:4].float().argmax(-1).tolist()
    assert out.logprobs[4].logprob <= 0


def test_temperature_matches_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 2
    ids = draws(logits, 20000, temperature=0.7)
    stat, df = chi_square(ids, torch.softmax(logits / 0.7, -1))
    assert stat < df + 6 * (2 * df) ** 0.5, (stat, df)
    wrong, _ = chi_square(ids, torch.softmax(logits, -1))  # the test can tell T=0.7 from T=1
    assert wrong > 3 * stat


def reference_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Naive one-row reference: temperature, top-k, top-p over the top-k set, min-p -> probs
    (V,)."""
    x = logits.double() / temperature
    if top_k:
        x[x < x.topk(top_k).values[-1]] = -torch.inf
    probs = torch.softmax(x, -1)
    if top_p < 1:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[list(nucleus(probs, top_p))] = True
        probs = torch.where(keep, probs, 0)
    if min_p:
        probs = torch.where(probs < min_p * probs.max(), 0, probs)
    return probs / probs.sum()


@pytest.fixture(params=["cpu-rejection", "sorted"])
def top_p_mode(request, monkeypatch):
    """Run top-p through both implementations: CPU rejection and the sorted mask (CUDA's)."""
    monkeypatch.setattr(sampling, "SORT_TOP_P_ON_CPU", request.param == "sorted")


@pytest.mark.parametrize(
    "kw",
    [
        {"top_k": 1},
        {"top_k": 5},
        {"top_k": 20, "temperature": 1.5},
        {"top_p": 0.3},
        {"top_p": 0.8},
        {"top_p": 0.95, "temperature": 0.8},
        {"min_p": 0.05},
        {"min_p": 0.3, "temperature": 2.0},
        {"top_k": 10, "top_p": 0.6},
        {"top_k": 30, "top_p": 0.9, "min_p": 0.1},
    ],
)
def test_filters_support_and_distribution(kw, top_p_mode):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2
    want = reference_probs(logits, **kw)
    ids = draws(logits, 20000, **kw)
    support = set(torch.nonzero(want).flatten().tolist())
    assert set(ids.tolist()) <= support
    assert len(set(ids.tolist())) >= len(support) - sum(1 for t in support if want[t] < 5e-4)
    stat, df = chi_square(ids, want)
    assert stat < df + 6 * (2 * df) ** 0.5 + 10, (stat, df)


def test_top_k_mask_exact():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    x = logits.clone()
    _top_k_(x, [3, 0, 200])
    assert set(torch.nonzero(x[0] > -torch.inf).flatten().tolist()) == set(
        logits[0].topk(3).indices.tolist()
    )
    assert torch.equal(x[1:], logits[1:])  # off, and k > V keeps everything


def test_top_p_smallest_set():
    # The sorted mask keeps exactly the smallest set reaching p, also at V = 49152.
    scale = torch.tensor([[0.5], [3.0], [8.0], [3.0]])
    big = torch.randn(4, 49152, generator=torch.Generator().manual_seed(3)) * scale
    ps = [0.9, 0.5, 0.99, 1.0]
    x = big.clone()
    _top_p_sorted_(x, torch.tensor(ps)[:, None])
    for row, p in enumerate(ps):
        kept = set(torch.nonzero(x[row] > -torch.inf).flatten().tolist())
        want = nucleus(torch.softmax(big[row], -1), p) if p < 1 else set(range(49152))
        assert kept == want
    # CPU rejection only ever returns nucleus members, with large and small nuclei.
    torch.manual_seed(0)
    out = sample(big[:3].repeat(20, 1), make(60, top_p=0.9)).token_ids
    nuclei = [nucleus(torch.softmax(big[row], -1), 0.9) for row in range(3)]
    assert all(t in nuclei[i % 3] for i, t in enumerate(out))


def test_logit_bias_forces_and_forbids():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(6))
    assert set(draws(logits, 500, logit_bias={42: 100.0}).tolist()) == {42}
    assert sample(logits[None], make(1, temperature=0, logit_bias={42: 100.0})).token_ids == [42]
    peaked = logits.clone()
    peaked[7] = 20.0  # nearly all mass on 7 until it is banned
    assert 7 not in set(draws(peaked, 2000, logit_bias={7: -100.0}).tolist())
    assert sample(peaked[None], make(1, temperature=0, logit_bias={7: -100.0})).token_ids != [7]


def test_repetition_penalty_matches_transformers():
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(7)) * 3
    prompt, output = [3, 5, 5, 9, 11], [11, 40, 41, 3]
    s = make(1, prompt=prompt, repetition_penalty=1.7)[0]
    for t in output:
        s.observe(t)
    ref = logits_process.RepetitionPenaltyLogitsProcessor(1.7)(
        torch.tensor([prompt + output]), logits.clone()
    )
    torch.testing.assert_close(process_logits(logits, [s]), ref)


def test_presence_frequency_exact():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(8))
    ss = make(1, presence_penalty=0.5, frequency_penalty=0.25, prompt=[1, 2]) + make(1)
    for t in [4, 4, 4, 9]:
        ss[0].observe(t)
        ss[1].observe(t)  # no penalties on row 1
    want = logits.clone()
    want[0, 4] -= 0.5 + 0.25 * 3
    want[0, 9] -= 0.5 + 0.25 * 1  # prompt ids 1, 2 are not penalised (OpenAI: output only)
    torch.testing.assert_close(process_logits(logits, ss), want, rtol=0, atol=1e-6)
    # Order: bias, then repetition penalty (a positive logit divided), then presence.
    s = make(1, logit_bias={4: 1.0}, repetition_penalty=2.0, presence_penalty=0.5)[0]
    s.observe(4)
    row = torch.zeros(1, V)
    row[0, 4] = 3.0
    assert process_logits(row, [s])[0, 4].item() == pytest.approx((3.0 + 1.0) / 2.0 - 0.5)


def run_steps(
    steps: list[torch.Tensor], s: SeqSampler, row: int, others: list[SeqSampler]
) -> list[int]:
    """Sample `s` at `row` of a batch padded with `others`, observing its tokens -> its ids."""
    out = []
    for logits in steps:
        batch = others[:row] + [s] + others[row:]
        ids = sample(logits[: len(batch)], batch).token_ids
        s.observe(ids[row])
        out.append(ids[row])
    return out


@pytest.mark.parametrize(
    ("vocab", "kw"),
    [
        (V, {"seed": 123, "temperature": 1.3, "top_p": 0.95, "presence_penalty": 0.3}),
        (V, {"seed": 123, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.3}),
        (V, {"seed": 7, "min_p": 0.05, "logit_bias": {3: 2.0}}),
        (49152, {"seed": 99, "top_p": 0.9}),
    ],
)
def test_seed_independent_of_batch(vocab, kw, top_p_mode):
    """A seeded row gives the same tokens alone and at row 3 of a batch of 8 mixed rows."""
    g = torch.Generator().manual_seed(9)
    steps = [torch.randn(8, vocab, generator=g) * 2 for _ in range(30 if vocab == V else 8)]
    others = (
        make(2, temperature=0.8)
        + make(1, seed=7, top_k=20)
        + make(1, temperature=0)
        + make(2, top_p=0.5, logprobs=True, top_logprobs=3)
        + make(1, seed=123, min_p=0.1)
    )
    alone = run_steps([s[:1] for s in steps], make(prompt=[1, 2, 3], **kw)[0], 0, [])
    moved = [torch.cat([s[1:4], s[:1], s[4:]]) for s in steps]  # row 3 sees what row 0 saw
    in_batch = run_steps(moved, make(prompt=[1, 2, 3], **kw)[0], 3, others)
    assert alone == in_batch
    assert len(set(alone)) > 1


def test_seed_offset_gives_different_streams():
    logits = torch.zeros(1, V)  # uniform: streams differ almost surely
    streams = []
    for offset in range(3):
        s = make(1, offset=offset, seed=5)[0]
        streams.append([sample(logits, [s]).token_ids[0] for _ in range(20)])
    assert len({tuple(x) for x in streams}) == 3
    s = make(1, offset=1, seed=5)[0]
    assert [sample(logits, [s]).token_ids[0] for _ in range(20)] == streams[1]


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs(k: int):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(10)) * 3
    ss = (
        make(1, logprobs=True, top_logprobs=k, logit_bias={1: 5.0})
        + make(1)
        + make(1, temperature=0, logprobs=True, top_logprobs=k, repetition_penalty=1.5, prompt=[2])
        + make(1, top_p=0.5, logprobs=True, top_logprobs=k)
    )
    out = sample(logits, ss)
    ref = torch.log_softmax(logits, -1)  # raw model logits: before bias, penalties, temperature
    assert out.logprobs[1] is None
    for row in (0, 2, 3):
        lp = out.logprobs[row]
        assert lp.token_id == out.token_ids[row] and lp.token == ""
        assert lp.logprob == pytest.approx(ref[row, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == k
        want = ref[row].topk(k) if k else None
        if k:
            assert [t for t, _, _ in lp.top] == want.indices.tolist()
            assert [v for _, _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-5)
            assert all(a[2] >= b[2] for a, b in zip(lp.top, lp.top[1:]))


def test_large_vocab_paths():
    logits = torch.randn(16, 49152, generator=torch.Generator().manual_seed(11)) * 3
    assert sample(logits, make(16, temperature=0)).token_ids == logits.argmax(-1).tolist()
    out = sample(logits, make(16, top_p=0.9, top_k=0))
    for row, t in enumerate(out.token_ids):
        assert t in nucleus(torch.softmax(logits[row], -1), 0.9)


def test_benchmark_print(capsys):
    """Not an assertion: ms per sample() call at V=49152 (median and best of 20)."""
    logits = torch.randn(16, 49152, generator=torch.Generator().manual_seed(12)) * 3
    cases = {
        "B=1 greedy": (logits[:1], make(1, temperature=0)),
        "B=16 greedy": (logits, make(16, temperature=0)),
        "B=16 T=1 full vocab": (logits, make(16)),
        "B=16 top_p=0.9": (logits, make(16, top_p=0.9)),
        "B=16 top_k=50 top_p=0.9 T=0.7": (logits, make(16, top_k=50, top_p=0.9, temperature=0.7)),
        "B=16 top_p + rep/presence penalties + 5 logprobs": (
            logits,
            make(
                16,
                top_p=0.9,
                prompt=list(range(500)),
                repetition_penalty=1.1,
                presence_penalty=0.5,
                logprobs=True,
                top_logprobs=5,
            ),
        ),
    }
    for s in cases["B=16 top_p + rep/presence penalties + 5 logprobs"][1]:
        for t in range(600, 700):
            s.observe(t)
    with capsys.disabled():
        print(f"\n[sampling bench] V=49152, torch threads={torch.get_num_threads()}")
        for name, (x, ss) in cases.items():
            times = []
            for _ in range(21):
                t0 = time.perf_counter()
                sample(x, ss)
                times.append((time.perf_counter() - t0) * 1e3)
            times = sorted(times[1:])
            print(f"  {name:<50} median {times[len(times) // 2]:7.3f} ms   best {times[0]:7.3f} ms")


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       layout=st.sampled_from(["contiguous", "expanded", "strided"]))
def test_greedy_ids_are_torchs_argmax(rows, width, seed, dtype, layout):
    """Ties (values drawn from a few integers) go to the first index, NaN counts as the
    largest, -inf rows give 0: as torch's argmax, on every layout the engine hands it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (rows, width), generator=g).to(dtype)
    x[torch.rand(rows, width, generator=g) < 0.05] = float("nan")
    x[torch.rand(rows, width, generator=g) < 0.1] = float("-inf")
    if layout == "expanded":  # a prefill's one row of logits for n > 1 choices
        x = x[:1].expand(rows, -1)
    elif layout == "strided":
        x = torch.cat([x, x], -1)[:, ::2]
    with torch.inference_mode():
        assert sampling.greedy_ids(x) == x.argmax(-1).tolist()


def test_a_lone_biased_row_is_biased_once_per_step():
    """The one row with a logit_bias (its tensors kept on the sampler) gets exactly its bias,
    at every step; the rows around it are untouched."""
    logits = torch.randn(3, V)
    ss = make(1, temperature=0) + make(1, temperature=0, logit_bias={3: 2.5, 7: -100.0}) + \
        make(1, temperature=0)
    want = logits.clone()
    want[1, 3] += 2.5
    want[1, 7] += -100.0
    for _ in range(3):
        assert torch.equal(process_logits(logits, ss), want)
        assert sample(logits, ss).token_ids == want.argmax(-1).tolist()
    alone = ss[1:2]
    assert torch.equal(process_logits(logits[1:2], alone), want[1:2])
