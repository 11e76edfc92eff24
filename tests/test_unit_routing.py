"""Unit tests of the pool's routing order (nbserve/pool/state.py `route_order`) and of
`Replica.prefix_match`, on Replica records around a stub engine whose cache holds the given
token lists: no model, no threads."""

from __future__ import annotations

from types import SimpleNamespace

from nbserve.engine.blocks import common_prefix_len
from nbserve.pool.state import Replica, route_order


def replica(index: int, load: int = 0, recent: list[list[int]] = (), max_batch: int = 8) -> Replica:
    """A replica whose engine's cache holds the prefixes `recent`."""
    held = [list(t) for t in recent]

    def cached_prefix(ids: list[int]) -> int:
        return max((common_prefix_len(ids, t) for t in held), default=0)

    engine = SimpleNamespace(max_batch=max_batch, cached_prefix=cached_prefix)
    return Replica(index, f"fake:{index}", engine, load=load)


def order(reps: list[Replica], ids: list[int], turn: int = 0) -> list[int]:
    return [r.index for r in route_order(reps, ids, turn, len(reps))]


PROMPT = list(range(1000, 1100))  # 100 tokens: affinity needs min(32, 50) = 32 more


# ----------------------------------------------------------------------------- load


def test_least_loaded_first() -> None:
    reps = [replica(0, load=3), replica(1, load=1), replica(2, load=2)]
    assert order(reps, PROMPT) == [1, 2, 0]


def test_ties_rotate_with_the_turn() -> None:
    reps = [replica(i) for i in range(3)]
    assert order(reps, PROMPT, turn=0) == [0, 1, 2]
    assert order(reps, PROMPT, turn=1) == [1, 2, 0]
    assert order(reps, PROMPT, turn=2) == [2, 0, 1]
    assert order(reps, PROMPT, turn=3) == [0, 1, 2]


def test_rotation_only_breaks_ties_of_load() -> None:
    reps = [replica(0, load=1), replica(1, load=0), replica(2, load=1)]
    assert order(reps, PROMPT, turn=2) == [1, 2, 0]
    assert order(reps, PROMPT, turn=0) == [1, 0, 2]


def test_rotation_counts_the_whole_pool_when_some_replicas_are_left_out() -> None:
    # Replica 1 is out (unhealthy or excluded): the turn still rotates over 3 positions.
    live = [replica(0), replica(2)]
    assert [r.index for r in route_order(live, PROMPT, 1, 3)] == [2, 0]
    assert [r.index for r in route_order(live, PROMPT, 2, 3)] == [2, 0]
    assert [r.index for r in route_order(live, PROMPT, 3, 3)] == [0, 2]


# ----------------------------------------------------------------------------- prefix affinity


def test_a_replica_holding_32_more_prompt_tokens_goes_first() -> None:
    reps = [replica(0), replica(1, load=2, recent=[PROMPT[:32] + [7, 7]])]
    assert order(reps, PROMPT) == [1, 0]


def test_31_tokens_of_prefix_do_not_beat_the_load() -> None:
    reps = [replica(0), replica(1, load=2, recent=[PROMPT[:31] + [7, 7]])]
    assert order(reps, PROMPT) == [0, 1]


def test_half_of_a_short_prompt_is_enough() -> None:
    prompt = list(range(20))  # need: max(8, min(32, 10)) = 10 tokens
    assert order([replica(0), replica(1, load=1, recent=[prompt[:10]])], prompt) == [1, 0]
    assert order([replica(0), replica(1, load=1, recent=[prompt[:9]])], prompt) == [0, 1]


def test_a_tiny_prompt_needs_at_least_8_tokens_of_prefix() -> None:
    prompt = list(range(12))  # half is 6, but reuse of fewer than 8 tokens is not worth it
    assert order([replica(0), replica(1, load=1, recent=[prompt[:7]])], prompt) == [0, 1]
    assert order([replica(0), replica(1, load=1, recent=[prompt[:8]])], prompt) == [1, 0]
    short = list(range(6))  # a whole 6-token prompt can never gain 8
    assert order([replica(0), replica(1, load=1, recent=[short])], short) == [0, 1]


def test_the_gain_is_counted_over_the_least_loaded_replicas_own_prefix() -> None:
    least = replica(0, recent=[PROMPT[:40]])
    other = replica(1, load=1, recent=[PROMPT[:71]])
    assert order([least, other], PROMPT) == [0, 1]  # 31 more tokens: not enough
    other = replica(1, load=1, recent=[PROMPT[:71], PROMPT[:72]])
    assert order([least, other], PROMPT) == [1, 0]  # 32 more


def test_affinity_yields_to_an_overloaded_replica() -> None:
    held = [PROMPT[:90]]
    # max_batch 8: the holder may carry up to the least load + 4.
    assert order([replica(0, load=1), replica(1, load=5, recent=held)], PROMPT) == [1, 0]
    assert order([replica(0, load=1), replica(1, load=6, recent=held)], PROMPT) == [0, 1]
    # A larger batch tolerates more load on the holder.
    assert order([replica(0, load=1), replica(1, load=6, recent=held, max_batch=16)],
                 PROMPT) == [1, 0]


def test_affinity_moves_only_the_holder_the_rest_stays_by_load() -> None:
    reps = [replica(0, load=0), replica(1, load=1), replica(2, load=3, recent=[PROMPT]),
            replica(3, load=2)]
    assert order(reps, PROMPT) == [2, 0, 1, 3]


def test_among_equal_prefixes_the_less_loaded_holder_wins() -> None:
    reps = [replica(0), replica(1, load=3, recent=[PROMPT]), replica(2, load=2, recent=[PROMPT])]
    assert order(reps, PROMPT) == [2, 0, 1]


def test_a_lone_replica_is_the_order() -> None:
    assert order([replica(4, load=9, recent=[PROMPT])], PROMPT) == [4]
