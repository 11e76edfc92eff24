"""ThreadTuner picks the faster thread count per forward size from timings, and keeps checking."""

from __future__ import annotations

import pytest
import torch

from nbserve.cpu.threads import ThreadTuner, default_choices


def drive(tuner: ThreadTuner, tokens: int, cost: dict[int, float], n: int) -> list[int]:
    """Run n forwards where `threads` takes cost[threads] seconds; return the choices made."""
    picks = []
    for _ in range(n):
        t = tuner.choose(tokens)
        tuner.record(tokens, t, cost[t])
        picks.append(t)
    return picks


def test_settles_on_the_faster_choice_per_size_class():
    tuner = ThreadTuner((1, 2), min_gap=8)
    picks = drive(tuner, 1, {1: 0.050, 2: 0.035}, 200)
    assert picks[-100:].count(2) >= 95
    picks = drive(tuner, 300, {1: 0.400, 2: 0.900}, 200)  # another size, another winner
    assert picks[-100:].count(1) >= 95
    summary = tuner.summary()
    assert summary["1"]["threads"] == 2 and summary["256-511"]["threads"] == 1
    assert summary["1"]["ms"]["2"] == pytest.approx(35.0)


def test_switches_when_the_winner_slows_down_and_checks_the_loser_less_and_less():
    tuner = ThreadTuner((1, 2), min_gap=4, max_gap=64)
    drive(tuner, 1, {1: 0.050, 2: 0.035}, 50)
    # another thread starts competing for the cores: 2 threads become 10x slower
    picks = drive(tuner, 1, {1: 0.050, 2: 0.450}, 300)
    assert picks[-200:].count(1) >= 195
    costly = picks[-200:].count(2)  # explorations of the loser
    assert 1 <= costly <= 5, picks[-200:]


def test_first_forward_of_each_thread_count_is_not_counted():
    tuner = ThreadTuner((1, 2))
    assert tuner.choose(1) == 2  # most threads first
    tuner.record(1, 2, 5.0)  # pool start-up: ignored
    assert tuner.choose(1) == 2
    tuner.record(1, 2, 0.030)
    assert tuner.choose(1) == 1
    tuner.record(1, 1, 9.0)  # ignored too
    assert tuner.choose(1) == 1
    tuner.record(1, 1, 0.050)
    assert tuner.choose(1) == 2
    assert tuner.summary()["1"]["ms"] == {"1": 50.0, "2": 30.0}


def test_single_choice_and_bad_choices():
    assert ThreadTuner((3,)).choose(10) == 3
    with pytest.raises(ValueError, match="thread choices"):
        ThreadTuner((0, 2))
    assert default_choices(1) == (1,)
    assert default_choices(2) == (1, 2)
    assert default_choices(16) == (8, 16)


def test_engine_tunes_on_cpu_and_leaves_the_callers_threads_alone(tiny_llama_dir):
    from nbserve.engine import Engine

    before = torch.get_num_threads()
    with Engine(str(tiny_llama_dir), max_batch=2, max_context=64, quiet=True) as engine:
        assert torch.get_num_threads() == before
        assert engine.complete("hello", max_tokens=4, temperature=0) is not None
        threads = engine.stats()["threads"]
        assert isinstance(threads, dict) and "1" in threads
    with Engine(str(tiny_llama_dir), max_batch=2, max_context=64, quiet=True,
                threads=1) as engine:
        assert engine.stats()["threads"] == 1
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        Engine(str(tiny_llama_dir), max_batch=2, max_context=64, quiet=True, threads=0)


def test_one_stalled_forward_does_not_condemn_a_choice():
    tuner = ThreadTuner((1, 2), min_gap=4)
    drive(tuner, 16, {1: 0.120, 2: 0.080}, 20)
    t = tuner.choose(16)
    tuner.record(16, t, 0.900)  # a single stall (another process took a core for a moment)
    picks = drive(tuner, 16, {1: 0.120, 2: 0.080}, 50)
    assert picks[-40:].count(2) >= 38


def test_recovers_quickly_once_the_contention_is_over():
    tuner = ThreadTuner((1, 2), min_gap=4, max_gap=64)
    drive(tuner, 1, {1: 0.050, 2: 0.035}, 30)
    drive(tuner, 1, {1: 0.050, 2: 0.450}, 300)  # a long busy period: 2 threads lose, often
    picks = drive(tuner, 1, {1: 0.050, 2: 0.035}, 200)  # quiet again
    first_back = picks.index(2)
    assert first_back <= 64 and picks[first_back:].count(2) >= len(picks[first_back:]) - 8
