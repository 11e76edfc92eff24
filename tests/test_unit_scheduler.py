"""Unit tests of the scheduler (nbserve/engine/scheduler.py), pure Python: FIFO admission,
n > 1 groups, the slot table's choice of slot (longest cached prefix, then least recently
used), prefill chunks, the decode list, finishing waiting and running sequences, and
`common_prefix_len` against a naive loop. No model, no torch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbserve.engine.scheduler import Scheduler, Sequence, SlotTable, common_prefix_len


def group(prompt: list[int], n: int = 1, tag: str = "g") -> list[Sequence]:
    """The n sequences of one request (they share the request record `tag`)."""
    return [Sequence(tag, i, list(prompt)) for i in range(n)]


def prefill_all(sched: Scheduler) -> None:
    """Run plans until nothing prefills, as the engine would: advance `computed` by each
    chunk, then give every sequence that finished its prefill a first output token (siblings
    of n > 1 take over their parent's prefill)."""
    while True:
        plan = sched.schedule()
        if not plan.prefills:
            return
        for work in plan.prefills:
            work.seq.computed += len(work.ids)
            if work.last:
                for seq in sched.running:
                    if seq.parent is work.seq:
                        seq.computed, seq.parent = work.seq.computed, None
                        seq.output_ids.append(0)
                work.seq.output_ids.append(0)


# ----------------------------------------------------------------------------- common_prefix_len


def naive_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@st.composite
def two_lists_with_a_shared_head(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    # Shared heads of every length around the 64-token blocks the function compares first,
    # tails from a 3-letter alphabet so that they often continue to agree for a while.
    head = draw(st.lists(st.integers(0, 2), max_size=200))
    tail = st.lists(st.integers(0, 2), max_size=80)
    return head + draw(tail), head + draw(tail)


@settings(max_examples=100, deadline=None)
@given(two_lists_with_a_shared_head())
def test_common_prefix_len_matches_a_naive_loop(pair: tuple[list[int], list[int]]) -> None:
    a, b = pair
    assert common_prefix_len(a, b) == naive_prefix_len(a, b)
    assert common_prefix_len(b, a) == naive_prefix_len(a, b)


@pytest.mark.parametrize("differ_at", [0, 1, 63, 64, 65, 127, 128, 129, 199])
def test_common_prefix_len_finds_the_first_difference_around_blocks(differ_at: int) -> None:
    a = list(range(200))
    b = a.copy()
    b[differ_at] = -1
    assert common_prefix_len(a, b) == differ_at
    assert common_prefix_len(a, a[:differ_at]) == differ_at  # one list is a prefix of the other
    assert common_prefix_len([], a) == 0


# ----------------------------------------------------------------------------- SlotTable


def test_take_prefers_the_free_slot_with_the_longest_cached_prefix() -> None:
    table = SlotTable(3)
    for _ in range(3):
        table.take([9])
    table.release(0, [1, 2, 9, 9])
    table.release(1, [1, 2, 3, 4, 5, 6])
    table.release(2, [1, 2, 3, 9])
    slot, reused = table.take([1, 2, 3, 4, 7, 7, 7])
    assert (slot, reused) == (1, 4)
    assert table.n_free == 2


def test_take_breaks_ties_by_the_least_recently_released_slot() -> None:
    table = SlotTable(3)
    for _ in range(3):
        table.take([5])
    table.release(2, [1, 1])  # released first: least recently used
    table.release(0, [2, 2])
    table.release(1, [3, 3])
    # A prompt that shares nothing with any slot: every slot ties at 0 cached tokens.
    assert table.take([7, 7, 7]) == (2, 0)
    assert table.take([7, 7, 7]) == (0, 0)
    assert table.take([7, 7, 7]) == (1, 0)


def test_take_ties_on_equal_prefixes_go_to_the_least_recently_used() -> None:
    table = SlotTable(2)
    table.take([0])
    table.take([0])
    table.release(1, [4, 4, 4, 1])
    table.release(0, [4, 4, 4, 2])
    assert table.take([4, 4, 4, 3]) == (1, 3)


def test_a_never_used_slot_is_taken_before_a_slot_holding_a_useful_cache() -> None:
    table = SlotTable(2)
    slot, _ = table.take([1, 2, 3])
    table.release(slot, [1, 2, 3])
    # An unrelated prompt should not evict the cached [1, 2, 3]: the empty slot goes first.
    other, reused = table.take([8, 8])
    assert other != slot and reused == 0
    assert table.take([1, 2, 3, 4]) == (slot, 3)


def test_reuse_is_capped_below_the_prompt_length() -> None:
    """At least one prompt token is always prefilled, for the logits of the first token."""
    table = SlotTable(1)
    table.take([1])
    table.release(0, [1, 2, 3, 4, 5])
    assert table.take([1, 2, 3]) == (0, 2)
    table.release(0, [1, 2, 3])
    assert table.take([1, 2, 3]) == (0, 2)
    table.release(0, [1])
    assert table.take([1]) == (0, 0)


def test_take_forgets_the_slot_cache_and_release_remembers_the_given_tokens() -> None:
    table = SlotTable(1)
    table.take([1])
    table.release(0, [1, 2, 3, 4])
    assert table.take([1, 2, 3, 4, 5]) == (0, 4)
    # The slot was handed out: its old tokens are no longer promised to anyone.
    table.release(0, [])
    assert table.take([1, 2, 3, 4, 5]) == (0, 0)


def test_take_without_a_prompt_reuses_nothing() -> None:
    table = SlotTable(2)
    table.take([1])
    table.release(0, [1, 2, 3])
    slot, reused = table.take(None)
    assert reused == 0 and table.n_free == 1
    assert slot == 1  # the never-used slot, keeping slot 0's cache for a real prompt


# ----------------------------------------------------------------------------- admission


def test_add_refuses_a_group_larger_than_max_batch() -> None:
    sched = Scheduler(max_batch=2, prefill_chunk=8)
    with pytest.raises(ValueError, match="n=3 .* max_batch=2"):
        sched.add(group([1, 2], n=3))
    assert sched.num_waiting == 0


def test_admission_is_fifo_and_bounded_by_the_free_slots() -> None:
    sched = Scheduler(max_batch=2, prefill_chunk=64)
    a, b, c = group([1, 2], tag="a"), group([3, 4], tag="b"), group([5, 6], tag="c")
    for g in (a, b, c):
        sched.add(g)
    plan = sched.schedule()
    assert [s.group for s in plan.admitted] == ["a", "b"]
    assert sched.num_waiting == 1 and [s.group for s in sched.running] == ["a", "b"]
    assert sched.schedule().admitted == []  # no free slot for c yet
    sched.finish(a[0])
    assert [s.group for s in sched.schedule().admitted] == ["c"]
    assert sched.num_waiting == 0


def test_a_group_of_n_waits_for_n_free_slots_and_blocks_the_queue_behind_it() -> None:
    sched = Scheduler(max_batch=3, prefill_chunk=64)
    first = group([1, 2, 3], tag="first")
    sched.add(first)
    sched.schedule()
    wide, small = group([4, 5], n=3, tag="wide"), group([6, 7], tag="small")
    sched.add(wide)
    sched.add(small)
    # Two slots are free: the n=3 group does not fit, and the later request does not jump it.
    assert sched.schedule().admitted == []
    assert sched.num_waiting == 4
    sched.finish(first[0])
    plan = sched.schedule()
    assert [s.group for s in plan.admitted] == ["wide"]  # the first choice stands for the group
    assert sorted(s.slot for s in wide) == [0, 1, 2]
    assert [s.group for s in sched.waiting[0]] == ["small"]


def test_siblings_of_n_gt_1_wait_for_the_first_choice_prefill() -> None:
    sched = Scheduler(max_batch=4, prefill_chunk=64)
    g = group([1, 2, 3, 4], n=3)
    sched.add(g)
    plan = sched.schedule()
    assert plan.admitted == [g[0]]
    assert [w.seq for w in plan.prefills] == [g[0]]  # only the first choice is prefilled
    assert g[1].parent is g[0] and g[2].parent is g[0]
    assert g[1].computed == 0 and g[2].computed == 0
    assert len({s.slot for s in g}) == 3  # every choice has a slot of its own


def test_admission_reuses_a_released_prefix() -> None:
    sched = Scheduler(max_batch=1, prefill_chunk=64)
    first = group([1, 2, 3, 4, 5])
    sched.add(first)
    prefill_all(sched)
    first[0].output_ids += [6]
    first[0].computed += 1  # the first output (0) was decoded, 6 was not: [1..5, 0] cached
    sched.finish(first[0])
    second = group([1, 2, 3, 4, 5, 0, 6, 9, 9])
    sched.add(second)
    plan = sched.schedule()
    seq = second[0]
    assert seq.slot == first[0].slot
    assert seq.cached_prompt == 6 and seq.computed == 6
    assert [(w.start, w.ids) for w in plan.prefills] == [(6, [6, 9, 9])]


# ----------------------------------------------------------------------------- one step's plan


def test_prefill_chunks_share_one_budget_across_sequences_oldest_first() -> None:
    sched = Scheduler(max_batch=3, prefill_chunk=10)
    a, b, c = group(list(range(6)), tag="a"), group(list(range(7)), tag="b"), group([1], tag="c")
    for g in (a, b, c):
        sched.add(g)

    plan = sched.schedule()
    assert [(w.seq.group, w.start, len(w.ids), w.last) for w in plan.prefills] == [
        ("a", 0, 6, True), ("b", 0, 4, False)]
    assert plan.prefills[1].ids == [0, 1, 2, 3]
    for w in plan.prefills:
        w.seq.computed += len(w.ids)
    a[0].output_ids.append(0)

    plan = sched.schedule()
    assert [(w.seq.group, w.start, w.ids) for w in plan.prefills] == [
        ("b", 4, [4, 5, 6]), ("c", 0, [1])]
    assert plan.prefills[0].last and plan.prefills[1].last
    assert plan.decode == [a[0]]


def test_one_long_prompt_is_split_into_chunks() -> None:
    sched = Scheduler(max_batch=1, prefill_chunk=4)
    g = group(list(range(10)))
    sched.add(g)
    chunks = []
    while True:
        plan = sched.schedule()
        if not plan.prefills:
            break
        (work,) = plan.prefills
        chunks.append((work.start, work.ids, work.last))
        work.seq.computed += len(work.ids)
    assert chunks == [(0, [0, 1, 2, 3], False), (4, [4, 5, 6, 7], False), (8, [8, 9], True)]


def test_decode_lists_the_prefilled_sequences_with_output_by_slot() -> None:
    sched = Scheduler(max_batch=4, prefill_chunk=3)
    long, short = group(list(range(7)), tag="long"), group([1, 2], n=2, tag="short")
    sched.add(short)
    sched.add(long)
    plan = sched.schedule()
    assert plan.decode == []  # nothing has an output token yet
    prefill_all(sched)
    plan = sched.schedule()
    assert plan.prefills == []
    assert plan.decode == sorted(sched.running, key=lambda s: s.slot)
    assert {id(s) for s in plan.decode} == {id(s) for s in [*short, *long]}
    assert not plan.empty


def test_an_idle_scheduler_plans_an_empty_step() -> None:
    sched = Scheduler(max_batch=2, prefill_chunk=8)
    assert sched.schedule().empty
    g = group([1, 2])
    sched.add(g)
    assert not sched.schedule().empty
    sched.finish(g[0])
    assert sched.schedule().empty


# ----------------------------------------------------------------------------- finish


def test_finish_of_a_running_sequence_frees_its_slot_and_remembers_its_tokens() -> None:
    sched = Scheduler(max_batch=1, prefill_chunk=64)
    g = group([1, 2, 3, 4])
    sched.add(g)
    prefill_all(sched)  # computed = 4, output [0] (not yet in the cache)
    sched.finish(g[0])
    assert g[0].finished and sched.running == [] and sched.slots.n_free == 1
    nxt = group([1, 2, 3, 4, 0, 5])
    sched.add(nxt)
    sched.schedule()
    assert nxt[0].cached_prompt == 4  # the prompt's 4 tokens; the unforwarded output is not


def test_finish_with_keep_cache_false_forgets_the_slot_tokens() -> None:
    sched = Scheduler(max_batch=1, prefill_chunk=64)
    g = group([1, 2, 3, 4])
    sched.add(g)
    prefill_all(sched)
    sched.finish(g[0], keep_cache=False)
    nxt = group([1, 2, 3, 4, 5])
    sched.add(nxt)
    sched.schedule()
    assert nxt[0].cached_prompt == 0 and nxt[0].computed == 0


def test_finish_of_a_waiting_sequence_removes_it_from_the_queue_without_a_slot() -> None:
    sched = Scheduler(max_batch=1, prefill_chunk=64)
    running, waiting, later = group([1], tag="r"), group([2], tag="w"), group([3], tag="l")
    for g in (running, waiting, later):
        sched.add(g)
    sched.schedule()
    gone = waiting[0]
    sched.finish(gone)
    assert gone.finished and gone.slot == -1
    assert sched.num_waiting == 1 and [s.group for s in sched.waiting[0]] == ["l"]
    assert sched.slots.n_free == 0  # the running one still holds the only slot
    sched.finish(running[0])
    assert [s.group for s in sched.schedule().admitted] == ["l"]


def test_finishing_one_choice_of_a_waiting_group_keeps_the_others_waiting() -> None:
    sched = Scheduler(max_batch=2, prefill_chunk=64)
    blocker, g = group([1, 1], n=2, tag="b"), group([2, 2], n=2, tag="g")
    sched.add(blocker)
    sched.add(g)
    sched.schedule()
    first, second = g
    sched.finish(first)
    assert sched.num_waiting == 1
    for s in list(blocker):
        sched.finish(s)
    plan = sched.schedule()
    assert plan.admitted == [second] and second.parent is None
    assert [w.seq for w in plan.prefills] == [second]  # now it prefills by itself
    assert first.slot == -1 and sched.running == [second]
