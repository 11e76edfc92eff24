"""Unit tests of the scheduler (nbserve/engine/scheduler.py) over both KV spaces
(nbserve/engine/blocks.py), pure Python: FIFO admission bounded by seats and blocks, a big
request passed by smaller ones at most `max_skips` times, n > 1 groups (siblings wait for the
first choice's prefill, then share its blocks), prefill chunks, the decode list, preemption of
the youngest, finishing waiting and running sequences, `SlotSpace`'s choice of row (longest
cached prefix, then least recently used), `common_prefix_len` against a naive loop; and
hypothesis properties: a random mix of adds, steps, finishes and preemptions over a tiny block
pool keeps the block books exact and every sequence's cached keys/values right, and every
request ends. No model, no torch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nbserve.engine.blocks import BlockSpace, KVSpace, SlotSpace, common_prefix_len
from nbserve.engine.scheduler import Scheduler, Sequence, StepPlan


def group(prompt: list[int], n: int = 1, tag: object = "g") -> list[Sequence]:
    """The n sequences of one request (they share the request record `tag`)."""
    return [Sequence(tag, i, list(prompt)) for i in range(n)]


def sched_with(max_batch: int, prefill_chunk: int = 64, space: KVSpace | None = None,
               max_skips: int = 16) -> Scheduler:
    """A scheduler; by default over a block pool big enough that only seats bound it."""
    return Scheduler(max_batch, prefill_chunk, space or BlockSpace(256, 4), max_skips)


both_spaces = pytest.mark.parametrize("kind", ["blocks", "slots"])


def space_of(kind: str, max_batch: int) -> KVSpace:
    return BlockSpace(64, 2) if kind == "blocks" else SlotSpace(max_batch, 64)


class FakeKV:
    """What the model's cache holds: the token whose keys/values each block position has.
    Writing a position checks that the block is the writer's alone (a shared block is never
    written), copying is the engine's `copy_prefix`."""

    def __init__(self, space: KVSpace):
        self.space = space
        self.cells: dict[int, dict[int, int]] = {}

    def write(self, seq: Sequence, start: int, ids: list[int]) -> None:
        bs = self.space.block_size
        for p, tok in enumerate(ids, start):
            assert p // bs < len(seq.table), f"position {p} is past the table {seq.table}"
            block = seq.table[p // bs]
            if isinstance(self.space, BlockSpace):
                assert self.space.refs[block] == 1, f"writes shared block {block} at {p}"
            self.cells.setdefault(block, {})[p % bs] = tok

    def copy(self, src: int, dst: int, n: int) -> None:
        row = self.cells.get(src, {})
        self.cells[dst] = {i: row[i] for i in range(n) if i in row}

    def check(self, seq: Sequence) -> None:
        """What `seq` has computed is in its blocks; positions a copy is still to bring are
        in that copy's source block."""
        bs = self.space.block_size
        for p in range(seq.computed):
            block, at = seq.table[p // bs], p % bs
            if seq.copy is not None and block == seq.copy[1]:
                assert at < seq.copy[2] and self.space.refs[seq.copy[0]] > 0
                block = seq.copy[0]
            got = self.cells.get(block, {}).get(at)
            assert got == seq.tokens[p], f"position {p} of {seq.tokens} holds {got}"


def drive(sched: Scheduler, steps: int = 1, *, token: Callable[[Sequence], int] = lambda s: 0,
          stop: Callable[[Sequence], bool] | None = None,
          kv: FakeKV | None = None) -> list[StepPlan]:
    """Play the engine's part (step.py) for `steps` steps: run the decode batch (write the
    fed token at `computed`, advance it by one, `sched.computed`), then the prefill chunks
    (write them, advance `computed` by each, `sched.computed`; after a last chunk,
    `sched.fork` and copy the partial block; if it samples, a first token for it and the
    forked choices). Each new token `token(seq)`; a sequence for which `stop` says so
    afterwards is finished (as max_tokens or a stop token would)."""
    plans = []

    def emit(seq: Sequence) -> None:
        seq.output_ids.append(token(seq))
        if stop is not None and stop(seq):
            sched.finish(seq)

    for _ in range(steps):
        plan = sched.schedule()
        for copy in sched.take_copies():  # cached positions found in part of a block
            if kv is not None:
                kv.copy(*copy)
        plans.append(plan)
        seqs = plan.decode + [w.seq for w in plan.prefills]
        assert len({id(s) for s in seqs}) == len(seqs)
        assert all(s in sched.running and s.parent is None for s in seqs)
        for s in plan.decode:
            if kv is not None:
                kv.write(s, s.computed, s.output_ids[-1:])
            s.computed += 1
            sched.computed(s)
        for s in plan.decode:
            emit(s)
        for work in plan.prefills:  # one forward for all chunks, then each one's aftermath
            assert work.start == work.seq.computed and work.ids
            assert work.ids == work.seq.tokens[work.start:work.start + len(work.ids)]
            if kv is not None:
                kv.write(work.seq, work.start, work.ids)
        for work in plan.prefills:
            seq = work.seq
            seq.computed += len(work.ids)
            sched.computed(seq)
            if not work.last:
                continue
            forked = []
            for sib, copy in sched.fork(seq):
                if copy is not None and kv is not None:
                    kv.copy(*copy)
                forked.append(sib)
            if work.samples:
                for s in [seq, *forked]:
                    emit(s)
    return plans


def prefill_all(sched: Scheduler) -> None:
    """Drive until every sequence has finished its prefill and has a first token (and no
    further: a sequence that has one is not decoded)."""
    while sched.waiting or any(s.prefilling or s.parent for s in sched.running):
        drive(sched)


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


# ----------------------------------------------------------------------------- SlotSpace


def holders(space: SlotSpace, n: int) -> list[Sequence]:
    """n sequences that took the rows 0..n-1 of a fresh space."""
    out = []
    for i in range(n):
        s = Sequence("h", 0, [9])
        assert space.admit(s, s.tokens, 0) == 0 and s.slot == i
        out.append(s)
    return out


def take(space: SlotSpace, prompt: list[int], limit: int | None = None) -> tuple[int, int]:
    """(row, tokens reused) for a new prompt, with the scheduler's limit: all but the last."""
    s = Sequence("t", 0, list(prompt))
    reused = space.admit(s, s.tokens, len(prompt) - 1 if limit is None else limit)
    return s.slot, reused


def test_admit_prefers_the_free_row_with_the_longest_cached_prefix() -> None:
    space = SlotSpace(3, 16)
    a, b, c = holders(space, 3)
    space.release(a, [1, 2, 9, 9], keep=True)
    space.release(b, [1, 2, 3, 4, 5, 6], keep=True)
    space.release(c, [1, 2, 3, 9], keep=True)
    assert space.cached_prefix([1, 2, 3, 4, 7, 7, 7], 6) == (4, 1)
    assert take(space, [1, 2, 3, 4, 7, 7, 7]) == (1, 4)
    assert space.n_free == 2 and space.n_used == 1


def test_admit_breaks_ties_by_the_least_recently_released_row() -> None:
    space = SlotSpace(3, 16)
    a, b, c = holders(space, 3)
    space.release(c, [1, 1], keep=True)  # released first: least recently used
    space.release(a, [2, 2], keep=True)
    space.release(b, [3, 3], keep=True)
    # A prompt that shares nothing with any row: every row ties at 0 cached tokens.
    assert take(space, [7, 7, 7]) == (2, 0)
    assert take(space, [7, 7, 7]) == (0, 0)
    assert take(space, [7, 7, 7]) == (1, 0)


def test_admit_ties_on_equal_prefixes_go_to_the_least_recently_used() -> None:
    space = SlotSpace(2, 16)
    a, b = holders(space, 2)
    space.release(b, [4, 4, 4, 1], keep=True)
    space.release(a, [4, 4, 4, 2], keep=True)
    assert take(space, [4, 4, 4, 3]) == (1, 3)


def test_a_never_used_row_is_taken_before_a_row_holding_a_useful_cache() -> None:
    space = SlotSpace(2, 16)
    (a,) = holders(space, 1)
    space.release(a, [1, 2, 3], keep=True)
    assert space.n_cached == 1
    # An unrelated prompt should not evict the cached [1, 2, 3]: the empty row goes first.
    assert take(space, [8, 8]) == (1, 0)
    assert take(space, [1, 2, 3, 4]) == (0, 3)


def test_reuse_is_capped_by_the_limit_below_the_prompt_length() -> None:
    """The scheduler's limit: at least one prompt token is prefilled, for its logits."""
    space = SlotSpace(1, 16)
    (a,) = holders(space, 1)
    space.release(a, [1, 2, 3, 4, 5], keep=True)
    s = Sequence("t", 0, [1, 2, 3])
    assert space.admit(s, s.tokens, 2) == 2
    space.release(s, [1, 2, 3], keep=True)
    t = Sequence("t", 0, [1, 2, 3])
    assert space.admit(t, t.tokens, 2) == 2  # all three cached: the limit holds
    space.release(t, [1], keep=True)
    assert take(space, [1]) == (0, 0)
    # and through the scheduler: a fully cached prompt still prefills its last token
    sched = sched_with(1, space=SlotSpace(1, 16))
    first = group([1, 2, 3])
    sched.add(first)
    prefill_all(sched)
    sched.finish(first[0])
    again = group([1, 2, 3])
    sched.add(again)
    plan = sched.schedule()
    assert again[0].cached_prompt == 2 and [(w.start, w.ids) for w in plan.prefills] == [
        (2, [3])]


def test_admit_forgets_the_row_cache_and_release_remembers_the_given_tokens() -> None:
    space = SlotSpace(1, 16)
    (a,) = holders(space, 1)
    space.release(a, [1, 2, 3, 4], keep=True)
    s = Sequence("t", 0, [1, 2, 3, 4, 5])
    assert space.admit(s, s.tokens, 4) == 4
    assert space.n_cached == 0  # the row was handed out: its old tokens are no longer promised
    space.release(s, [], keep=True)
    assert take(space, [1, 2, 3, 4, 5]) == (0, 0)


def test_release_with_keep_false_forgets_the_row_tokens() -> None:
    space = SlotSpace(1, 16)
    (a,) = holders(space, 1)
    space.release(a, [1, 2, 3, 4], keep=False)
    assert space.n_cached == 0 and take(space, [1, 2, 3, 4, 5]) == (0, 0)


def test_a_forked_choice_takes_a_never_used_row() -> None:
    """grow (for an n > 1 choice, which copies its prompt) reuses nothing: the never-used row
    goes first, keeping row 0's cache for a real prompt."""
    space = SlotSpace(3, 16)
    (a,) = holders(space, 1)
    space.release(a, [1, 2, 3], keep=True)
    parent = Sequence("p", 0, [5, 5])
    parent.computed = space.admit(parent, parent.tokens, 1)
    assert parent.slot == 1  # the never-used row, not row 0's cache
    child = Sequence("p", 1, [5, 5])
    assert space.fork(parent, child, 2) == (1, 2, 2)
    assert child.slot == 2 and space.n_free == 1 and space.n_cached == 1
    assert space.fork(parent, Sequence("p", 2, [5, 5]), 2) == (1, 0, 2)  # the last row
    with pytest.raises(MemoryError):
        space.fork(parent, Sequence("p", 3, [5, 5]), 2)
    assert space.n_free == 0


# ----------------------------------------------------------------------------- admission


def test_add_refuses_a_group_larger_than_max_batch() -> None:
    sched = sched_with(2, 8)
    with pytest.raises(ValueError, match="n=3 .* max_batch=2"):
        sched.add(group([1, 2], n=3))
    assert sched.num_waiting == 0


@both_spaces
def test_admission_is_fifo_and_bounded_by_the_seats(kind: str) -> None:
    sched = sched_with(2, space=space_of(kind, 2))
    a, b, c = group([1, 2], tag="a"), group([3, 4], tag="b"), group([5, 6], tag="c")
    for g in (a, b, c):
        sched.add(g)
    plan = sched.schedule()
    assert [s.group for s in plan.admitted] == ["a", "b"]
    assert sched.num_waiting == 1 and [s.group for s in sched.running] == ["a", "b"]
    assert sched.schedule().admitted == []  # no free seat for c yet
    sched.finish(a[0])
    assert [s.group for s in sched.schedule().admitted] == ["c"]
    assert sched.num_waiting == 0


def test_a_group_of_n_that_lacks_seats_is_passed_at_most_max_skips_times() -> None:
    """(It used to block the queue behind it at once.) With max_skips=1, one smaller request
    passes the n=3 group that lacks seats; then the group waits for seats at the head."""
    sched = sched_with(3, max_skips=1)
    first = group([1, 2, 3], tag="first")
    sched.add(first)
    sched.schedule()
    wide = group([4, 5], n=3, tag="wide")
    small, later = group([6, 7], tag="small"), group([8, 9], tag="later")
    for g in (wide, small, later):
        sched.add(g)
    plan = sched.schedule()  # 2 seats: "wide" does not fit; "small" passes, "later" may not
    assert [s.group for s in plan.admitted] == ["small"]
    assert wide[0].skipped == 1
    assert [[s.group for s in g] for g in sched.waiting] == [["wide"] * 3, ["later"]]
    sched.finish(first[0])
    assert sched.schedule().admitted == []  # 2 seats: still too few, and "later" waits
    sched.finish(small[0])
    plan = sched.schedule()
    assert [s.group for s in plan.admitted] == ["wide"]  # the first choice stands for the group
    assert [s.group for s in sched.waiting[0]] == ["later"]


def test_with_max_skips_0_a_request_that_does_not_fit_blocks_the_queue() -> None:
    sched = sched_with(3, max_skips=0)
    first = group([1, 2, 3], tag="first")
    sched.add(first)
    sched.schedule()
    wide, small = group([4, 5], n=3, tag="wide"), group([6, 7], tag="small")
    sched.add(wide)
    sched.add(small)
    assert sched.schedule().admitted == []
    assert sched.num_waiting == 4
    sched.finish(first[0])
    assert [s.group for s in sched.schedule().admitted] == ["wide"]


def test_a_request_too_big_for_the_free_blocks_is_passed_at_most_max_skips_times() -> None:
    space = BlockSpace(10, 2)
    sched = sched_with(8, space=space, max_skips=2)
    first = group([1] * 8, tag="first")
    sched.add(first)
    drive(sched)  # prefilled: 4 blocks, and a first token
    assert space.n_free == 6 and first[0].output_ids == [0]
    big = group([2] * 11, tag="big")  # its prompt and first token: 6 blocks
    smalls = [group([3 + i], tag=f"s{i}") for i in range(4)]  # 1 block each
    for g in (big, *smalls):
        sched.add(g)
    plan = sched.schedule()  # 6 free, 1 kept in reserve for the running: big does not fit
    assert [s.group for s in plan.admitted] == ["s0", "s1"]
    assert big[0].skipped == 2
    assert [g[0].group for g in sched.waiting] == ["big", "s2", "s3"]
    for _ in range(3):
        assert sched.schedule().admitted == []  # nothing passes big any more
    for seq in list(sched.running):
        sched.finish(seq)
    plan = sched.schedule()
    assert [s.group for s in plan.admitted] == ["big", "s2", "s3"]


def test_a_request_that_fits_the_pool_is_admitted_without_the_copy_it_has_no_room_for() -> None:
    """Found by test_every_request_ends: a finished sequence's tail matches the start of a
    request that needs the whole pool; holding the tail for a copy would need one block more
    than there are, so the request is admitted without the copy (it used to wait forever)."""
    space = BlockSpace(8, 2)
    sched = sched_with(3, 1, space=space, max_skips=0)
    first = group([0])
    sched.add(first)
    drive(sched, 3, stop=lambda s: len(s.output_ids) >= 1)
    assert first[0].finished and space.n_cached == 1
    big = group([0] * 10, n=3)  # the prompt and each choice's first token: 6 + 2 blocks
    sched.add(big)
    plan = sched.schedule()
    assert [s.group for s in plan.admitted] == ["g"] and big[0].copy is None
    drive(sched, 40, stop=lambda s: len(s.output_ids) >= 1)
    assert all(s.finished for s in big) and space.n_free == 8


def test_admission_counts_the_blocks_promised_in_the_same_pass() -> None:
    """A burst: each request fits the free blocks alone, not together. Those admitted first
    have taken no block yet; the next is not admitted against the same free blocks (only to
    be preempted as soon as the older ones' prefills take them)."""
    space = BlockSpace(8, 2)
    sched = sched_with(4, space=space)
    burst = [group([i] * 5, tag=f"r{i}") for i in range(4)]  # 3 blocks each
    for g in burst:
        sched.add(g)
    plan = sched.schedule()
    assert [s.group for s in plan.admitted] == ["r0", "r1"]
    assert sched.preemptions == 0 and space.n_free == 2


def test_admission_counts_the_blocks_running_prefills_are_still_to_take() -> None:
    """A request admitted in an earlier step whose prefill has not taken its blocks yet (the
    chunk budget went to older ones) has them promised."""
    space = BlockSpace(10, 2)
    sched = sched_with(4, 2, space=space)
    a, b = group([1] * 7, tag="a"), group([2] * 7, tag="b")  # 4 blocks each
    sched.add(a)
    drive(sched)  # a: 2 of its 7 tokens, 1 block
    sched.add(b)
    (plan,) = drive(sched)  # 9 free, 3 promised to a, 1 kept: b fits
    assert [s.group for s in plan.admitted] == ["b"] and b[0].table == []
    c = group([3] * 3, tag="c")  # 2 blocks: 8 free, 2 + 4 promised, 1 kept
    sched.add(c)
    assert sched.schedule().admitted == []
    drive(sched, 30, stop=lambda s: len(s.output_ids) >= 2)
    assert sched.preemptions == 0 and all(g[0].finished for g in (a, b, c))


def test_siblings_of_n_gt_1_wait_for_the_first_choice_prefill_then_share_it() -> None:
    space = BlockSpace(64, 2)
    sched = sched_with(4, space=space)
    g = group([1, 2, 3, 4, 5], n=3)
    sched.add(g)
    plan = sched.schedule()
    assert plan.admitted == [g[0]]
    assert [w.seq for w in plan.prefills] == [g[0]]  # only the first choice is prefilled
    assert g[1].parent is g[0] and g[2].parent is g[0]
    assert g[1].computed == 0 and g[2].computed == 0 and g[1].table == g[2].table == []
    kv = FakeKV(space)
    for work in plan.prefills:
        kv.write(work.seq, work.start, work.ids)
        work.seq.computed += len(work.ids)
        sched.computed(work.seq)
    forked = sched.fork(g[0])
    assert [s for s, _ in forked] == [g[1], g[2]]
    for sib, copy in forked:
        assert sib.parent is None and sib.computed == 5
        assert sib.table[:2] == g[0].table[:2]  # the full blocks: shared
        assert copy == (g[0].table[2], sib.table[2], 1)  # the partial one: copied
        kv.copy(*copy)
        kv.check(sib)
    assert [space.refs[b] for b in g[0].table] == [3, 3, 1]
    assert len({s.table[2] for s in g}) == 3


@both_spaces
def test_admission_reuses_a_released_prefix(kind: str) -> None:
    sched = sched_with(1, space=space_of(kind, 1))
    first = group([1, 2, 3, 4, 5])
    sched.add(first)
    drive(sched, 2, token=lambda s: 6 if s.output_ids else 0)  # prefill, then decode "0"
    assert first[0].tokens == [1, 2, 3, 4, 5, 0, 6] and first[0].computed == 6
    sched.finish(first[0])  # [1..5, 0] cached: 6 was sampled, never fed
    second = group([1, 2, 3, 4, 5, 0, 6, 9, 9])
    sched.add(second)
    plan = sched.schedule()
    seq = second[0]
    if kind == "slots":
        assert seq.slot == 0
    assert seq.cached_prompt == 6 and seq.computed == 6
    assert [(w.start, w.ids) for w in plan.prefills] == [(6, [6, 9, 9])]


def test_a_prefix_ending_inside_a_block_is_copied_before_the_step_runs() -> None:
    """Blocks of 4 and 6 cached tokens: the first block is shared, the next two positions are
    copied into the new sequence's own block (`take_copies`, made before the forward), and
    only the rest is prefilled."""
    space = BlockSpace(64, 4)
    kv = FakeKV(space)
    sched = sched_with(2, space=space)
    first = group([1, 2, 3, 4, 5])
    sched.add(first)
    drive(sched, 2, token=lambda s: 6 if s.output_ids else 0, kv=kv)
    sched.finish(first[0])  # [1..5, 0] cached
    second = group([1, 2, 3, 4, 5, 0, 7, 7])
    sched.add(second)
    plan = sched.schedule()
    seq = second[0]
    assert seq.cached_prompt == 6 and seq.copy is not None
    assert [(w.start, w.ids) for w in plan.prefills] == [(6, [7, 7])]
    copies = sched.take_copies()
    assert copies == [(first_tail := copies[0][0], seq.table[1], 2)] and seq.copy is None
    assert kv.cells[first_tail] == {0: 5, 1: 0}
    assert sched.take_copies() == []
    for copy in copies:
        kv.copy(*copy)
    kv.write(seq, 6, [7, 7])
    seq.computed = 8
    sched.computed(seq)
    kv.check(seq)
    check_books(sched, kv)


def test_a_running_sequence_shares_its_committed_blocks_with_a_new_one() -> None:
    space = BlockSpace(64, 2)
    sched = sched_with(4, space=space)
    a = group([1, 2, 3, 4, 5, 6, 7], tag="a")
    sched.add(a)
    drive(sched)
    b = group([1, 2, 3, 4, 5, 6, 8, 8], tag="b")
    sched.add(b)
    plan = sched.schedule()
    assert b[0].cached_prompt == 6 and b[0].table[:3] == a[0].table[:3]
    assert [(w.seq.group, w.start, w.ids) for w in plan.prefills] == [("b", 6, [8, 8])]
    assert plan.decode == [a[0]]


# ----------------------------------------------------------------------------- one step's plan


def test_prefill_chunks_share_one_budget_across_sequences_oldest_first() -> None:
    sched = sched_with(3, 10)
    a, b = group(list(range(6)), tag="a"), group(list(range(10, 17)), tag="b")
    c = group([1], tag="c")
    for g in (a, b, c):
        sched.add(g)
    (plan,) = drive(sched)
    assert [(w.seq.group, w.start, len(w.ids), w.last) for w in plan.prefills] == [
        ("a", 0, 6, True), ("b", 0, 4, False)]
    assert plan.prefills[1].ids == [10, 11, 12, 13]
    assert a[0].output_ids == [0] and b[0].output_ids == []
    (plan,) = drive(sched)
    assert [(w.seq.group, w.start, w.ids) for w in plan.prefills] == [
        ("b", 4, [14, 15, 16]), ("c", 0, [1])]
    assert plan.prefills[0].last and plan.prefills[1].last
    assert plan.decode == [a[0]]


def test_one_long_prompt_is_split_into_chunks() -> None:
    sched = sched_with(1, 4)
    sched.add(group(list(range(10))))
    chunks = []
    while True:
        (plan,) = drive(sched)
        if not plan.prefills:
            break
        (work,) = plan.prefills
        chunks.append((work.start, work.ids, work.last))
    assert chunks == [(0, [0, 1, 2, 3], False), (4, [4, 5, 6, 7], False), (8, [8, 9], True)]


@both_spaces
def test_decode_lists_the_prefilled_sequences_with_output_by_slot(kind: str) -> None:
    sched = sched_with(4, 3, space=space_of(kind, 4))
    long, short = group(list(range(7)), tag="long"), group([1, 2], n=2, tag="short")
    sched.add(short)
    sched.add(long)
    (plan,) = drive(sched)
    assert plan.decode == []  # nothing had an output token yet
    prefill_all(sched)
    plan = sched.schedule()
    assert plan.prefills == []
    assert plan.decode == sorted(sched.running, key=lambda s: s.slot)
    assert {id(s) for s in plan.decode} == {id(s) for s in [*short, *long]}
    assert not plan.empty


def test_an_idle_scheduler_plans_an_empty_step() -> None:
    sched = sched_with(2, 8)
    assert sched.schedule().empty
    g = group([1, 2])
    sched.add(g)
    assert not sched.schedule().empty
    sched.finish(g[0])
    assert sched.schedule().empty


# ----------------------------------------------------------------------------- preemption


def test_the_youngest_is_preempted_when_no_block_is_free() -> None:
    space = BlockSpace(6, 2)
    sched = sched_with(2, space=space)
    old, young = group([1, 1, 1], tag="old"), group([2, 2, 2], tag="young")
    sched.add(old)
    sched.add(young)
    kv = FakeKV(space)
    drive(sched, kv=kv)  # both prefilled: 2 blocks each, one token each
    drive(sched, kv=kv)  # decode position 3: still in the second block
    assert space.n_free == 2
    drive(sched, 2, kv=kv)  # positions 4 and 5: a third block each
    assert space.n_free == 0 and young[0].computed == 6 and young[0].keyed == 3
    (plan,) = drive(sched, kv=kv)  # old needs a block for position 6: young goes
    assert plan.decode == [old[0]] and sched.preemptions == 1
    y = young[0]
    assert sched.running == [old[0]] and y.resumed and y.computed == 0 and y.table == []
    assert [g[0].group for g in sched.waiting] == ["young"]
    # its three full blocks were cached; old took the tail one, the first two stay
    assert space.n_cached == 2 and space.cached_prefix(y.tokens, 6) == (4, 2)
    sched.finish(old[0])
    (plan,) = drive(sched, kv=kv)
    assert plan.admitted == []  # it was admitted long ago
    (work,) = plan.prefills
    assert (work.start, work.ids) == (4, [0, 0]) and work.last and not work.samples
    assert y.computed == y.target == 6 and y.output_ids == [0] * 4  # no token sampled
    kv.check(y)
    (plan,) = drive(sched, kv=kv)
    assert plan.decode == [y] and y.output_ids == [0] * 5
    kv.check(y)


def test_a_preempted_sequence_recomputes_what_the_cache_lost_without_sampling() -> None:
    space = BlockSpace(4, 2)
    sched = sched_with(2, space=space)
    a = group([1, 2, 3], tag="a")
    sched.add(a)
    kv = FakeKV(space)
    drive(sched, 2, kv=kv, token=lambda s: 7)  # tokens [1, 2, 3, 7, 7], computed 4
    sched.preempt(a[0])
    assert space.cached_prefix(a[0].tokens, 4) == (4, 2)
    other = Sequence("other", 0, [9] * 8)  # someone takes every block, evicting a's cache
    assert space.grow(other, 8) and space.evictions == 2
    space.release(other, [], keep=False)
    assert space.cached_prefix(a[0].tokens, 4) == (0, 0)
    (plan,) = drive(sched, kv=kv, token=lambda s: 7)
    (work,) = plan.prefills
    assert work.seq is a[0] and (work.start, work.ids) == (0, [1, 2, 3, 7])
    assert work.last and not work.samples and a[0].output_ids == [7, 7]
    kv.check(a[0])


def test_a_prefill_with_no_one_younger_shrinks_to_the_blocks_there_are() -> None:
    space = BlockSpace(4, 2)
    sched = sched_with(2, 64, space=space)
    old, young = group([1, 1, 1], tag="old"), group([2] * 9, tag="young")
    sched.add(old)
    drive(sched)  # old: 2 blocks
    # young is let in as if it had fitted when admitted (older ones grew since)
    sched._start(young, partial=True)
    (plan,) = drive(sched)
    (work,) = plan.prefills
    assert work.seq is young[0] and (work.start, len(work.ids), work.last) == (0, 4, False)
    assert plan.decode == [old[0]] and space.n_free == 0 and sched.preemptions == 0
    (plan,) = drive(sched)  # old needs a block for position 4: young, the youngest, goes
    assert plan.decode == [old[0]] and plan.prefills == [] and sched.preemptions == 1
    assert young[0].resumed and sched.waiting[0] == young


def test_a_sibling_without_a_block_for_its_copy_waits_to_be_recomputed() -> None:
    space = BlockSpace(3, 2)
    sched = sched_with(3, space=space)
    g = group([1, 2, 3], n=3)
    # (admission would not let it in: 2 blocks and one per other choice; see below) force
    # it, as if blocks had been free at admission and older sequences took them since
    sched._start(g, partial=True)
    (plan,) = drive(sched)
    assert [w.seq for w in plan.prefills] == [g[0]]
    assert g[1].parent is None and g[1].computed == 3 and g[1] in sched.running
    assert g[2] not in sched.running and g[2].resumed and sched.waiting[0] == [g[2]]
    assert g[0].output_ids == g[1].output_ids == [0] and g[2].output_ids == []
    sched.finish(g[0])
    sched.finish(g[1])
    (plan,) = drive(sched)
    assert plan.admitted == [] and [(w.seq, w.start) for w in plan.prefills] == [(g[2], 2)]
    assert g[2].output_ids == [0]  # sampled: it never had a token


def test_admission_counts_a_block_for_each_other_choice() -> None:
    """An n=3 group of a 3-token prompt in blocks of 2: 2 blocks for the first choice, one
    each for the other two (the copy of the partial block)."""
    sched = sched_with(3, space=BlockSpace(3, 2))
    g = group([1, 2, 3], n=3)
    sched.add(g)
    assert sched._cost(g, partial=True) == 4
    assert sched.schedule().admitted == []  # 4 blocks > 3: it waits
    roomy = sched_with(3, space=BlockSpace(4, 2))
    roomy.add(g)
    assert roomy.schedule().admitted == [g[0]]
    drive(roomy, 2)
    assert roomy.preemptions == 0 and all(len(s.output_ids) == 2 for s in g)


# ----------------------------------------------------------------------------- finish


@both_spaces
def test_finish_of_a_running_sequence_frees_its_blocks_and_keeps_its_tokens(kind: str) -> None:
    space = space_of(kind, 1)
    sched = sched_with(1, space=space)
    g = group([1, 2, 3, 4])
    sched.add(g)
    prefill_all(sched)  # computed = 4, output [0] (not yet in the cache)
    sched.finish(g[0])
    assert g[0].finished and sched.running == [] and space.n_free == space.n_blocks
    assert g[0].table == []
    nxt = group([1, 2, 3, 4, 0, 5])
    sched.add(nxt)
    sched.schedule()
    assert nxt[0].cached_prompt == 4  # the prompt's 4 tokens; the unforwarded output is not


@both_spaces
def test_finish_with_keep_cache_false_forgets_the_tokens(kind: str) -> None:
    sched = sched_with(1, space=space_of(kind, 1))
    g = group([1, 2, 3, 4])
    sched.add(g)
    prefill_all(sched)
    sched.finish(g[0], keep_cache=False)
    assert sched.space.n_cached == 0
    nxt = group([1, 2, 3, 4, 5])
    sched.add(nxt)
    sched.schedule()
    assert nxt[0].cached_prompt == 0 and nxt[0].computed == 0


def test_finish_of_a_waiting_sequence_removes_it_from_the_queue_without_blocks() -> None:
    sched = sched_with(1)
    running, waiting, later = group([1], tag="r"), group([2], tag="w"), group([3], tag="l")
    for g in (running, waiting, later):
        sched.add(g)
    sched.schedule()
    gone = waiting[0]
    sched.finish(gone)
    assert gone.finished and gone.slot == -1
    assert sched.num_waiting == 1 and [s.group for s in sched.waiting[0]] == ["l"]
    assert sched.space.n_used == 1  # the running one's block
    sched.finish(gone)  # twice: no-op
    sched.finish(running[0])
    assert [s.group for s in sched.schedule().admitted] == ["l"]


def test_finishing_one_choice_of_a_waiting_group_keeps_the_others_waiting() -> None:
    sched = sched_with(2)
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


def test_finishing_the_first_choice_before_its_prefill_lets_the_others_prefill() -> None:
    space = BlockSpace(64, 2)
    sched = sched_with(3, 4, space=space)
    g = group([1, 2, 3, 4, 5, 6, 7], n=3)
    sched.add(g)
    drive(sched)  # the first 4 tokens of the first choice: 2 blocks committed
    sched.finish(g[0])
    for sib in g[1:]:
        assert sib.parent is None and sib.computed == 4 and sib.table == g[1].table
    assert [space.refs[b] for b in g[1].table] == [2, 2]
    (plan,) = drive(sched)  # two prefills now, sharing the budget of 4
    assert [(w.seq, w.start, w.ids) for w in plan.prefills] == [
        (g[1], 4, [5, 6, 7]), (g[2], 4, [5])]
    prefill_all(sched)
    assert g[1].output_ids and g[2].output_ids and sched.preemptions == 0


# ----------------------------------------------------------------------------- properties


@dataclass(eq=False)
class Req:
    """The engine's per-request record, as far as these tests need it."""

    max_tokens: int
    seqs: list[Sequence] = field(default_factory=list)


def token_of(seq: Sequence) -> int:
    """A deterministic next token that differs between choices (so that a wrong share or copy
    shows) and repeats often (so that prefixes are shared)."""
    return (len(seq.tokens) + seq.index) % 3


def check_books(sched: Scheduler, kv: FakeKV | None = None) -> None:
    """Every invariant of the scheduler and its block pool."""
    space = sched.space
    bs = space.block_size
    running = sched.running
    assert len({id(s) for s in running}) == len(running) <= sched.max_batch
    for g in sched.waiting:
        assert g
        for s in g:
            assert not s.finished and s.table == [] and s not in running and s.parent is None
    held: Counter[int] = Counter()
    for s in running:
        assert not s.finished
        if s.parent is not None:
            assert s.parent in running and s.parent.parent is None
            assert s.table == [] and s.computed == 0 and s.parent.prefilling
            continue
        assert len(set(s.table)) == len(s.table)
        assert len(s.table) * bs >= s.computed
        assert s.computed <= s.target
        held.update(s.table)
        if s.copy is not None:  # a copy's source is held until the copy is made
            held[s.copy[0]] += 1
        if kv is not None:
            kv.check(s)
    if isinstance(space, BlockSpace):
        for b in range(space.n_blocks):
            assert space.refs[b] == held[b], f"block {b}"
        free, unused = set(space._free) | set(space._fresh), set(space._unused)
        assert len(free) == len(space._free) + len(space._fresh) and not free & unused
        assert not set(held) & free and not set(held) & unused
        assert len(free) + len(unused) + len(held) == space.n_blocks
        assert space.n_free + space.n_used == space.n_blocks
        for s in running:
            if s.parent is not None:
                continue
            assert s.keyed == s.computed // bs
            for i in range(s.keyed):
                content = space._content.get(s.table[i])
                if content is not None:  # a keyed block holds what its holders computed
                    assert content[1] == tuple(s.tokens[i * bs:(i + 1) * bs])
        for b, key in space._key_of.items():
            assert space._by_key.get(key) == b
    else:
        slots = [s.slot for s in running if s.parent is None]
        assert len(set(slots)) == len(slots) and not set(slots) & space._free
        assert space.n_free + len(slots) == space.n_blocks


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, steps, finishes, preemptions and restarts over a tiny block pool."""

    @initialize(n_blocks=st.integers(6, 12), bs=st.integers(2, 4), max_batch=st.integers(1, 4),
                chunk=st.integers(1, 8), max_skips=st.integers(0, 3))
    def setup(self, n_blocks: int, bs: int, max_batch: int, chunk: int, max_skips: int) -> None:
        self.space = BlockSpace(n_blocks, bs)
        self.sched = Scheduler(max_batch, chunk, self.space, max_skips)
        self.kv = FakeKV(self.space)
        self.max_context = n_blocks * bs
        self.reqs: list[Req] = []

    def live(self) -> list[Sequence]:
        return [s for r in self.reqs for s in r.seqs if not s.finished]

    def stop(self, seq: Sequence) -> bool:
        return len(seq.output_ids) >= seq.group.max_tokens or seq.total_len >= self.max_context

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=16), n=st.integers(1, 3),
          max_tokens=st.integers(1, 12))
    def add(self, prompt: list[int], n: int, max_tokens: int) -> None:
        n = min(n, self.sched.max_batch)
        prompt = prompt[:self.max_context - 1]
        req = Req(max_tokens)
        req.seqs = group(prompt, n, tag=req)
        self.reqs.append(req)
        self.sched.add(req.seqs)

    @rule()
    def step(self) -> None:
        drive(self.sched, token=token_of, stop=self.stop, kv=self.kv)

    @rule(steps=st.integers(2, 8))
    def steps(self, steps: int) -> None:
        drive(self.sched, steps, token=token_of, stop=self.stop, kv=self.kv)

    @rule(data=st.data(), keep=st.booleans())
    def finish(self, data: st.DataObject, keep: bool) -> None:
        """A cancel, an error (keep False), or a stop the engine saw."""
        if self.live():
            self.sched.finish(data.draw(st.sampled_from(self.live())), keep_cache=keep)

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """(The scheduler preempts the youngest; any running sequence but a waiting choice
        may be.)"""
        heads = [s for s in self.sched.running if s.parent is None]
        if heads:
            self.sched.preempt(data.draw(st.sampled_from(heads)))

    @rule(keep=st.booleans())
    def restart(self, keep: bool) -> None:
        """Throw everything away (as the engine's fail_running does)."""
        for seq in self.live():
            self.sched.finish(seq, keep_cache=keep)
        assert not self.sched.running and not self.sched.waiting
        assert self.space.n_free == self.space.n_blocks

    @invariant()
    def books(self) -> None:
        if hasattr(self, "sched"):
            check_books(self.sched, self.kv)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for seq in self.live():
            self.sched.finish(seq)
        assert not self.sched.running and not self.sched.waiting
        assert all(r == 0 for r in self.space.refs)
        assert self.space.n_free == self.space.n_blocks == self.space.n_used + self.space.n_free
        assert self.sched.schedule().empty


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
test_scheduler_keeps_its_books = SchedulerMachine.TestCase


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, int, int, int, int, list[tuple[list[int], int, int]]]:
    """A pool, seats and requests that each fit the pool alone (as the engine guarantees by
    capping the context at what the pool holds)."""
    n_blocks, bs = draw(st.integers(4, 12)), draw(st.integers(1, 4))
    max_batch, chunk = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    max_skips = draw(st.integers(0, 3))
    reqs = []
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, min(3, max_batch)))
        length = draw(st.integers(1, 16))
        k = draw(st.integers(1, 10))
        # one choice grown to its end, and the admission of the n choices, fit the pool
        if -(-(length + k) // bs) > n_blocks or -(-(length + 1) // bs) + n - 1 > n_blocks:
            continue
        reqs.append((draw(st.lists(st.integers(0, 1), min_size=length, max_size=length)), n, k))
    return n_blocks, bs, max_batch, chunk, max_skips, reqs


@settings(max_examples=200, deadline=None)
@given(workloads(), st.integers(0, 3))
def test_every_request_ends(work: tuple, arrive_every: int) -> None:
    """Requests that stop after k tokens all end, each with its k tokens per choice, within
    a bounded number of steps: no request starves, nothing deadlocks, whatever passes or
    preempts what."""
    n_blocks, bs, max_batch, chunk, max_skips, specs = work
    space = BlockSpace(n_blocks, bs)
    sched = Scheduler(max_batch, chunk, space, max_skips)
    kv = FakeKV(space)
    reqs = []
    pending = list(specs)

    def stop(seq: Sequence) -> bool:
        return len(seq.output_ids) >= seq.group.max_tokens

    bound = sum(n * (len(p) + k) for p, n, k in specs) * 4 + 50
    for t in range(bound):
        if pending and (arrive_every == 0 or t % arrive_every == 0):
            prompt, n, k = pending.pop(0)
            req = Req(k)
            req.seqs = group(prompt, n, tag=req)
            reqs.append(req)
            sched.add(req.seqs)
        if not pending and not sched.running and not sched.waiting:
            break
        drive(sched, token=token_of, stop=stop, kv=kv)
        check_books(sched, kv)
    else:
        raise AssertionError(f"not done after {bound} steps: running {sched.running}, "
                             f"waiting {list(sched.waiting)}")
    for req in reqs:
        for s in req.seqs:
            assert s.finished and len(s.output_ids) == req.max_tokens
    assert space.n_free == n_blocks and all(r == 0 for r in space.refs)


def test_a_request_waits_for_a_running_prefill_of_its_prefix_and_then_shares_it() -> None:
    """Users of one new system prompt arriving together prefill it once: the others wait
    until the first one's blocks hold it (being passed meanwhile does not count as a skip)."""
    sched = sched_with(4, prefill_chunk=8, space=BlockSpace(64, 4))
    system = list(range(100, 120))  # 20 tokens: five blocks of 4
    first, second = group(system + [1, 2], tag="first"), group(system + [3], tag="second")
    other = group([7, 8, 9], tag="other")
    for g in (first, second, other):
        sched.add(g)
    prefilled: list[tuple[str, int]] = []
    for _ in range(8):
        for plan in drive(sched):
            prefilled += [(w.seq.group, len(w.ids)) for w in plan.prefills]
    assert sum(n for tag, n in prefilled if tag == "first") == 22
    assert sum(n for tag, n in prefilled if tag == "second") == 1  # 20 of 21 from the cache
    assert second[0].cached_prompt == 20 and second[0].skipped == 0
    tags = [tag for tag, _ in prefilled]
    assert sum(n for tag, n in prefilled if tag == "other") == 3
    assert tags.index("other") < tags.index("second")  # with nothing to wait for: not held up


def test_slot_counts_can_be_read_from_another_thread_while_rows_change() -> None:
    """/stats reads the counts from the server's thread while the engine's admits and
    releases rows: no 'set changed size during iteration'."""
    import sys
    import threading

    space = SlotSpace(64, 16)
    errors: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        try:
            while not stop.is_set():
                space.n_cached, space.n_free, space.n_used  # noqa: B018 - reads to race
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(3000):
            held = [Sequence("h", 0, [i, j]) for j in range(8)]
            for s in held:
                space.admit(s, s.tokens, 1)
            for s in held:
                space.release(s, s.tokens, keep=True)
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(switch)
    assert not errors, errors[0]
