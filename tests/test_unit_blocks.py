"""Unit tests of the paged cache's bookkeeping (nbserve/engine/blocks.py, `BlockSpace`), pure
Python: prefix sharing by hash chain and reference counts, the prompt's last token never taken
from the cache, cached blocks outliving their sequence, least-recently-used eviction (a
released chain from its tail), `grow`, `fork`, `keep=False`, `admission_cost` against what
admitting really takes, and the order block ids are handed out. No model, no torch."""

from __future__ import annotations

import pytest

from nbserve.engine.blocks import ROOT_KEY, BlockSpace, block_key
from nbserve.engine.scheduler import Sequence


def seq(prompt: list[int]) -> Sequence:
    return Sequence("g", 0, list(prompt))


def computed_seq(space: BlockSpace, prompt: list[int], limit: int | None = None) -> Sequence:
    """A sequence admitted with `prompt` and prefilled through all of it (blocks taken,
    keys/values "written", full blocks committed), as the scheduler and engine would."""
    s = seq(prompt)
    s.computed = space.admit(s, s.tokens, len(prompt) - 1 if limit is None else limit)
    space.take_copy(s)  # (the engine copies the positions found in part of a block)
    assert space.grow(s, len(prompt))
    s.computed = len(prompt)
    space.commit(s, s.tokens, s.computed)
    return s


def check(space: BlockSpace, running: list[Sequence]) -> None:
    """The pool's books agree with the sequences that hold blocks."""
    held = [b for s in running for b in s.table + ([s.copy[0]] if s.copy else [])]
    for b in range(space.n_blocks):
        assert space.refs[b] == held.count(b)
    in_use = set(held)
    free = set(space._free) | set(space._fresh)
    assert not in_use & free and not in_use & set(space._unused)
    assert not free & set(space._unused) and not set(space._free) & set(space._fresh)
    assert len(free) + len(space._unused) + len(in_use) == space.n_blocks
    assert space.n_touched == sum(space._touched) == space.n_blocks - len(space._fresh)
    assert space.n_free + space.n_used == space.n_blocks
    assert all(b in space._content for b in space._unused)
    for (parent, first), blocks in space._under.items():
        assert blocks and all(space._content[b][0] == parent and space._content[b][1][0] == first
                              for b in blocks)
    assert sum(map(len, space._under.values())) == len(space._content)
    for key, b in space._by_key.items():
        assert space._key_of[b] == key
        parent, tokens = space._content[b]
        assert block_key(parent, tokens) == key


# ----------------------------------------------------------------------------- sharing


def test_two_sequences_with_one_prompt_share_its_full_blocks() -> None:
    space = BlockSpace(16, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks and one partial
    a = computed_seq(space, prompt)
    assert a.table == [0, 1, 2, 3] and a.keyed == 3 and space.n_keyed == 3
    b = seq(prompt)
    assert space.admit(b, b.tokens, len(prompt) - 1) == 6
    assert b.table == a.table[:3] and b.keyed == 3 and b.last_key == a.last_key
    assert [space.refs[x] for x in a.table] == [2, 2, 2, 1]
    assert space.grow(b, 7) and b.table[3] not in a.table  # the partial block is its own
    check(space, [a, b])


def test_a_different_second_block_shares_only_the_first() -> None:
    space = BlockSpace(16, 2)
    a = computed_seq(space, [1, 2, 3, 4, 5, 6, 7])
    c = seq([1, 2, 9, 9, 5, 6, 7])  # same third block's tokens, under another parent
    assert space.admit(c, c.tokens, 6) == 2
    assert c.table == a.table[:1] and space.refs[a.table[0]] == 2
    assert [space.refs[x] for x in a.table[1:]] == [1, 1, 1]
    assert space.cached_prefix([1, 2, 9, 9, 5, 6, 7], 7) == (2, 0)
    assert space.cached_prefix([1, 2, 3, 4, 5, 6, 7], 7) == (6, 0)
    check(space, [a, c])


def test_keys_chain_through_the_parents() -> None:
    space = BlockSpace(8, 2)
    a = computed_seq(space, [1, 2, 3, 4])
    k1 = block_key(ROOT_KEY, (1, 2))
    assert a.last_key == block_key(k1, (3, 4))
    assert space._key_of[a.table[0]] == k1


def test_the_last_prompt_token_is_never_taken_from_the_cache() -> None:
    space = BlockSpace(16, 2)
    prompt = [1, 2, 3, 4, 5, 6]  # exactly 3 full blocks, all cached
    a = computed_seq(space, prompt)
    a_blocks = list(a.table)
    space.release(a, a.tokens, keep=True)
    assert space.cached_prefix(prompt, 6) == (6, 3)  # all three, unused
    b = seq(prompt)
    # the scheduler's limit for a new prompt: all but its last token; the third block's first
    # position is copied into a block of b's own (the last is computed there)
    assert space.admit(b, b.tokens, len(prompt) - 1) == 5 and len(b.table) == 3
    assert b.table[:2] == a_blocks[:2] and b.copy == (a_blocks[2], b.table[2], 1)
    assert space.cached_prefix(prompt, 5) == (5, 0)  # b holds them all: none unused
    assert space.cached_prefix(prompt[:1], 6) == (1, 0)  # one position of the first block
    check(space, [b])
    assert space.take_copy(b) == (a_blocks[2], b.table[2], 1) and b.copy is None
    assert space.cached_prefix(prompt, 6) == (6, 1)  # the third block, unused again
    check(space, [b])


def test_share_false_never_shares() -> None:
    space = BlockSpace(8, 2, share=False)
    a = computed_seq(space, [1, 2, 3, 4, 5])
    assert a.keyed == 0 and space.n_keyed == 0
    b = seq([1, 2, 3, 4, 5])
    assert space.admit(b, b.tokens, 4) == 0 and b.table == []
    space.release(a, a.tokens, keep=True)
    assert space.n_cached == 0 and space.n_free == 8


def test_a_twin_computed_at_the_same_time_stays_private() -> None:
    """Two sequences that prefilled one prompt side by side: the first to commit gives the
    key; the other's equal block is not keyed (one key, one block), and is freed on release."""
    space = BlockSpace(8, 2)
    a, b = seq([1, 2, 3]), seq([1, 2, 3])
    for s in (a, b):
        assert space.admit(s, s.tokens, 2) == 0 and space.grow(s, 3)
    for s in (a, b):
        s.computed = 3
        space.commit(s, s.tokens, 3)
    assert a.keyed == b.keyed == 1 and a.last_key == b.last_key
    assert a.table[0] in space._key_of and b.table[0] not in space._key_of
    check(space, [a, b])
    keyed = a.table[0]
    space.release(b, b.tokens, keep=True)
    space.release(a, a.tokens, keep=True)
    # one keyed block, and each one's partly filled last block (kept for copying)
    assert space.n_cached == 3 and space.n_keyed == 1
    c = seq([1, 2, 3])
    assert space.admit(c, c.tokens, 2) == 2 and c.table == [keyed]
    check(space, [c])


def test_a_block_whose_content_differs_from_its_key_is_not_found() -> None:
    """A hash collision (forced here) never hands out a block with other tokens."""
    space = BlockSpace(8, 2)
    a = computed_seq(space, [1, 2, 3])
    space._content[a.table[0]] = (ROOT_KEY, (7, 7))  # as if another prefix had that key
    assert space.cached_prefix([1, 2, 3], 3) == (0, 0)


# ----------------------------------------------------------------------------- caching


def test_cached_blocks_survive_release_and_are_reused() -> None:
    space = BlockSpace(8, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a = computed_seq(space, prompt)
    blocks = list(a.table)
    space.release(a, a.tokens, keep=True)
    assert a.table == [] and a.keyed == 0 and a.last_key == ROOT_KEY
    assert space.n_free == 8 and space.n_used == 0 and space.n_cached == 4
    assert all(space.refs[b] == 0 for b in blocks)
    # the partial block has no key, but what it holds is remembered for copying
    assert blocks[3] in space._unused and blocks[3] not in space._key_of
    b = seq(prompt + [8])
    assert space.admit(b, b.tokens, 7) == 7 and b.table[:3] == blocks[:3]
    assert b.copy == (blocks[3], b.table[3], 1) and b.table[3] not in blocks
    assert space.n_cached == 0 and space.n_free == 3 and space.evictions == 0
    check(space, [b])
    space.take_copy(b)
    assert space.n_cached == 1 and space.n_free == 4
    check(space, [b])


def test_release_with_keep_false_drops_the_keys() -> None:
    space = BlockSpace(8, 2)
    a = computed_seq(space, [1, 2, 3, 4, 5])
    space.release(a, a.tokens, keep=False)
    assert space.n_cached == 0 and space.n_keyed == 0 and space._by_key == {}
    assert len(space._free) + len(space._fresh) == 8
    assert space.cached_prefix([1, 2, 3, 4, 5], 5) == (0, 0)
    check(space, [])


def test_keep_false_keeps_a_block_another_sequence_still_uses() -> None:
    space = BlockSpace(8, 2)
    a = computed_seq(space, [1, 2, 3, 4, 5])
    b = computed_seq(space, [1, 2, 3, 4, 9])
    assert b.table[:2] == a.table[:2]
    space.release(b, b.tokens, keep=False)
    assert space.cached_prefix([1, 2, 3, 4], 4) == (4, 0)  # a's blocks: still keyed, in use
    check(space, [a])


def test_eviction_takes_the_least_recently_released_block_first() -> None:
    space = BlockSpace(4, 2)
    a = computed_seq(space, [1, 1])
    b = computed_seq(space, [2, 2])
    space.release(a, a.tokens, keep=True)  # released first: oldest
    space.release(b, b.tokens, keep=True)
    c = computed_seq(space, [3, 3])  # a cached block before a never-used one: a's, the oldest
    assert space.evictions == 1 and space.n_cached == 1 and space.n_touched == 2
    assert space.cached_prefix([1, 1], 2) == (0, 0)
    assert space.cached_prefix([2, 2], 2) == (2, 1)
    d = seq([4, 4, 4, 4, 4, 4])
    assert space.grow(d, 2) and space.evictions == 2  # then b's
    assert space.cached_prefix([2, 2], 2) == (0, 0)
    assert space.grow(d, 6) and space.evictions == 2  # nothing cached left: never-used ones
    assert space.n_touched == 4
    # Every block is in use now: nothing is evicted from a running sequence.
    assert not space.grow(d, 8)
    assert space.cached_prefix([3, 3], 2) == (2, 0)
    check(space, [c, d])


def test_reuse_makes_a_cached_block_the_most_recently_used() -> None:
    space = BlockSpace(3, 2)
    a = computed_seq(space, [1, 1])
    b = computed_seq(space, [2, 2])
    space.release(a, a.tokens, keep=True)
    space.release(b, b.tokens, keep=True)
    again = seq([1, 1, 5])
    assert space.admit(again, again.tokens, 2) == 2
    space.release(again, again.tokens, keep=True)  # [1, 1] is now newer than [2, 2]
    x = seq([9] * 6)
    assert space.grow(x, 2)  # the oldest cached block, [2, 2]'s, before the never-used one
    assert space.cached_prefix([1, 1], 2) == (2, 1)
    assert space.cached_prefix([2, 2], 2) == (0, 0)


def test_a_released_chain_is_evicted_from_its_tail() -> None:
    """Evicting a chain's first block would make all of it unreachable; its last block goes
    first, so the pool keeps the longest prefix it can."""
    space = BlockSpace(4, 2)
    a = computed_seq(space, [1, 2, 3, 4, 5, 6, 7, 8])
    space.release(a, a.tokens, keep=True)
    x = seq([9, 9])
    assert space.grow(x, 2) and space.evictions == 1
    assert space.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8], 8) == (6, 3)
    assert space.grow(x, 4)
    assert space.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8], 8) == (4, 2)


# ----------------------------------------------------------------------------- grow, fork


def test_grow_takes_what_the_length_needs_and_refuses_without_change_when_short() -> None:
    space = BlockSpace(4, 3)
    s = seq([1] * 10)
    assert space.grow(s, 0) and s.table == []
    assert space.grow(s, 1) and s.table == [0]
    assert space.grow(s, 3) and s.table == [0]  # still one block of 3 positions
    assert space.grow(s, 4) and s.table == [0, 1]
    t = seq([2])
    assert space.grow(t, 3) and t.table == [2]
    before = (list(s.table), list(space.refs), space.n_free)
    assert not space.grow(s, 10)  # needs 2 more blocks, 1 is free
    assert (list(s.table), list(space.refs), space.n_free) == before
    assert space.grow(s, 9) and s.table == [0, 1, 3]
    check(space, [s, t])


def test_low_block_ids_are_handed_out_first() -> None:
    space = BlockSpace(8, 2)
    a, b = seq([1] * 6), seq([2] * 4)
    assert space.grow(a, 6) and a.table == [0, 1, 2]
    assert space.grow(b, 4) and b.table == [3, 4]
    space.release(a, a.tokens, keep=False)
    c = seq([3] * 6)
    assert space.grow(c, 6) and c.table == [0, 1, 2]  # freed low ids before never-used high


def test_touched_counts_blocks_that_ever_held_contents() -> None:
    """What a lazily committed cache has made resident: freed blocks come back first, then
    cached ones (evicted), never-used ones last."""
    space = BlockSpace(8, 2)
    assert space.n_touched == 0
    a = computed_seq(space, [1, 2, 3, 4, 5])  # 3 blocks
    assert space.n_touched == 3
    space.release(a, a.tokens, keep=False)
    b = computed_seq(space, [6, 7, 8, 9, 10])  # the same 3 blocks again
    assert space.n_touched == 3 and b.table == [0, 1, 2]
    space.release(b, b.tokens, keep=True)  # all 3 stay cached (2 full, 1 partly filled)
    c = computed_seq(space, [11, 12, 13, 14, 15])  # the 3 cached ones, evicted
    assert space.n_touched == 3 and space.evictions == 3
    d = computed_seq(space, [16, 17, 18, 19, 20])  # c holds all touched: 3 never used
    assert space.n_touched == 6 and d.table == [3, 4, 5]
    space.release(c, c.tokens, keep=False)
    space.release(d, d.tokens, keep=True)
    for start in (20, 30, 40):  # distinct prompts, one at a time: no new block is touched
        space.release(computed_seq(space, list(range(start, start + 5))), [], keep=True)
    assert space.n_touched == 6 and space.n_cached == 5  # (the full blocks of the last one)
    check(space, [])


def test_distinct_prompts_one_at_a_time_touch_one_prompt_of_blocks() -> None:
    """450 distinct prompts, each cached after it ends, fill no more of the pool than one
    of them needs (the issue: every new prompt took never-used blocks until the pool was
    full, and the cache's resident memory grew with every prompt seen)."""
    space = BlockSpace(4096, 16)
    for i in range(450):
        prompt = [i] + list(range(1000, 1100))  # 101 tokens: 7 blocks
        s = computed_seq(space, prompt)
        space.release(s, s.tokens, keep=True)
    assert space.n_touched == 7 and space.n_cached == 7
    check(space, [])


def test_distinct_prompts_with_retention_touch_at_most_the_retained_blocks_more() -> None:
    """With `retain` cached blocks kept, 450 distinct prompts fill the retained part of the
    pool and no more: past it, each new prompt evicts the least recently used prefix."""
    space = BlockSpace(4096, 16, retain=64)
    for i in range(450):
        s = computed_seq(space, [i] + list(range(1000, 1100)))  # 7 blocks
        space.release(s, s.tokens, keep=True)
    assert 64 <= space.n_cached <= 64 + 7 and space.n_touched == space.n_cached
    check(space, [])


def test_two_conversations_taking_turns_keep_their_prefixes() -> None:
    """Two users' chats, one request at a time, each turn its chat so far plus a few new
    tokens: with a few contexts retained, every turn finds its whole history cached, where
    evicting before touching a never-used block made each user's turn evict the other's
    history (a found prefix of 0 blocks from the third turn on)."""
    space = BlockSpace(1024, 4, retain=64)
    chats: dict[int, list[int]] = {0: [], 1: []}
    for turn in range(6):
        for user in (0, 1):
            history = chats[user]
            prompt = history + [1000 * (user + 1) + 10 * turn + j for j in range(9)]
            found = space.cached_prefix(prompt, len(prompt) - 1)[0]
            assert found >= len(history) - len(history) % 4 - 4 * (turn == 0), (turn, user)
            s = computed_seq(space, prompt)
            space.release(s, s.tokens, keep=True)
            chats[user] = prompt
    check(space, [])


def test_retain_is_checked() -> None:
    with pytest.raises(ValueError, match="retain must be between 0 and n_blocks=8"):
        BlockSpace(8, 2, retain=9)


def test_give_back_returns_freed_blocks_as_runs_and_counts_them_untouched() -> None:
    space = BlockSpace(16, 2)
    held = [computed_seq(space, [i, i + 1, i + 2]) for i in range(0, 15, 3)]  # 2 blocks each
    assert space.n_touched == 10 and space.give_back(4) == []  # nothing freed
    space.release(held[1], [], keep=False)  # blocks 2, 3
    space.release(held[3], [], keep=False)  # blocks 6, 7
    assert space.give_back(0) == [(2, 4), (6, 8)]
    assert space.n_touched == 6 and space.give_back(0) == []
    check(space, [held[0], held[2], held[4]])
    space.release(held[4], held[4].tokens, keep=True)  # blocks 8, 9: cached, not given back
    space.release(held[2], [], keep=False)  # blocks 4, 5: between two runs given back
    # the run grows over never-used neighbours (2, 3 and 6, 7 given back before), up to `reach`
    assert space.give_back(1) == [(3, 7)]
    assert space.give_back(1) == []
    space.release(held[0], [], keep=False)  # blocks 0, 1: the never-used 2.. up to reach 8
    assert space.give_back(8) == [(0, 8)]
    assert space.n_touched == 2 == space.n_cached
    again = seq([5] * 6)
    assert space.grow(again, 6) and again.table == [9, 8, 0]  # cached (the tail first), then 0
    check(space, [again])


def test_fork_shares_the_full_blocks_and_copies_the_partial_one() -> None:
    space = BlockSpace(8, 2)
    parent = computed_seq(space, [1, 2, 3, 4, 5])
    child = seq([1, 2, 3, 4, 5])
    copy = space.fork(parent, child, 5)
    assert child.table[:2] == parent.table[:2] and len(child.table) == 3
    assert copy == (parent.table[2], child.table[2], 1)
    assert child.table[2] != parent.table[2]
    assert child.keyed == parent.keyed == 2 and child.last_key == parent.last_key
    assert [space.refs[b] for b in parent.table] == [2, 2, 1]
    check(space, [parent, child])


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    space = BlockSpace(8, 2)
    parent = computed_seq(space, [1, 2, 3, 4])
    child = seq([1, 2, 3, 4])
    assert space.fork(parent, child, 4) is None
    assert child.table == parent.table and space.n_free == 6
    check(space, [parent, child])


def test_fork_without_a_free_block_for_the_copy_raises_and_changes_nothing() -> None:
    space = BlockSpace(2, 2)
    parent = computed_seq(space, [1, 2, 3])
    child = seq([1, 2, 3])
    with pytest.raises(MemoryError):
        space.fork(parent, child, 3)
    assert child.table == [] and space.refs == [1, 1]
    check(space, [parent])


# ----------------------------------------------------------------------------- partial blocks


def test_a_prompt_agreeing_with_part_of_a_cached_block_copies_those_positions() -> None:
    """Two chats sharing a system prompt that ends inside a block: the whole blocks are
    shared, the agreeing positions of the next one copied into a block of the new prompt's
    own (which then holds its own tokens after them)."""
    space = BlockSpace(16, 4)
    system = [1, 2, 3, 4, 5, 6]  # one block and half of the next
    a = computed_seq(space, system + [7, 8, 9])
    space.release(a, a.tokens, keep=True)
    b = seq(system + [10, 11])
    assert space.cached_prefix(b.tokens, 6) == (6, 2)
    assert space.admit(b, b.tokens, 6) == 6
    src = b.copy[0] if b.copy else -1
    assert b.table[0] == space._by_key[block_key(ROOT_KEY, (1, 2, 3, 4))]
    assert space._content[src] == (b.last_key, (5, 6, 7, 8)) and b.copy == (src, b.table[1], 2)
    assert b.keyed == 1 and space.refs[src] == 1  # held for the copy, not shared
    check(space, [b])
    assert space.take_copy(b) == (src, b.table[1], 2) and space.take_copy(b) is None
    assert space.refs[src] == 0 and src in space._unused
    assert space.grow(b, 8)
    b.computed = 8
    space.commit(b, b.tokens, 8)  # its own second block gets its own key
    assert b.keyed == 2 and space._content[b.table[1]][1] == (5, 6, 10, 11)
    check(space, [b])


def test_the_next_turn_of_a_chat_copies_the_partly_filled_last_block() -> None:
    space = BlockSpace(16, 4)
    turn = computed_seq(space, [1, 2, 3, 4, 5, 6])  # one full block, two positions more
    tail = turn.table[1]
    space.release(turn, turn.tokens, keep=True)
    assert space._content[tail][1] == (5, 6) and tail not in space._key_of
    nxt = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert space.admit(nxt, nxt.tokens, 8) == 6 and nxt.copy == (tail, nxt.table[1], 2)
    check(space, [nxt])


def test_the_longest_agreeing_candidate_is_copied_up_to_the_limit() -> None:
    space = BlockSpace(16, 8)
    for prompt in ([1, 2, 9], [1, 2, 3, 4, 9], [1, 2, 3, 9]):
        done = computed_seq(space, prompt)
        space.release(done, done.tokens, keep=True)
    b = seq([1, 2, 3, 4, 5, 6])
    assert space.cached_prefix(b.tokens, 5) == (4, 1)
    assert space.cached_prefix(b.tokens, 3) == (3, 1)  # the limit caps the copy
    assert space.admit(b, b.tokens, 5) == 4 and b.copy is not None and b.copy[2] == 4
    assert space._content[b.copy[0]][1] == (1, 2, 3, 4, 9)


def test_the_source_of_a_copy_is_not_evicted_before_the_copy_is_made() -> None:
    space = BlockSpace(4, 2)
    a = computed_seq(space, [1, 2, 3])  # blocks 0 (keyed) and 1 (partly filled)
    space.release(a, a.tokens, keep=True)
    b = seq([1, 2, 3, 4])
    assert space.admit(b, b.tokens, 3) == 3 and b.copy == (1, 2, 1)
    other = seq([7, 8, 9])
    assert space.grow(other, 2) and not space.grow(other, 3)  # the one free block, no more
    assert space.evictions == 0 and space._content[1] == (b.last_key, (3,))
    check(space, [b, other])
    space.take_copy(b)
    assert space.grow(other, 3) and space.evictions == 1  # now the source can go
    check(space, [b, other])


def test_a_sequence_released_before_its_copy_lets_the_source_go_and_keeps_no_tail() -> None:
    space = BlockSpace(8, 2)
    a = computed_seq(space, [1, 2, 3])
    space.release(a, a.tokens, keep=True)
    b = seq([1, 2, 3, 4])
    b.computed = space.admit(b, b.tokens, 3)
    dst = b.table[1]
    space.release(b, b.tokens[:b.computed], keep=True)
    assert b.copy is None and dst in space._free and dst not in space._content
    assert space.n_cached == 2 and all(r == 0 for r in space.refs)
    check(space, [])


def test_without_a_block_for_the_copy_only_whole_blocks_are_taken() -> None:
    space = BlockSpace(4, 2)
    hog = seq([9])
    assert space.grow(hog, 2)  # block 0
    a = computed_seq(space, [1, 2, 3])  # blocks 1 and 2, cached after the release
    space.release(a, a.tokens, keep=True)  # one never-used block left
    b = seq([1, 2, 3, 4])
    assert space.admit(b, b.tokens, 3) == 3 and b.copy == (2, 3, 1)
    c = seq([1, 2, 3, 4])
    assert space.admit(c, c.tokens, 3) == 2 and c.copy is None  # no block left for a copy
    check(space, [hog, b, c])


def test_admission_cost_without_the_copy_leaves_out_the_source_it_would_hold() -> None:
    """A cached partly filled block: copying it holds it (one block more) until the copy is
    made; without the copy, admission costs what a prompt with nothing cached costs."""
    space = BlockSpace(8, 2)
    a = computed_seq(space, [1])
    space.release(a, a.tokens, keep=True)  # a tail holding [1]
    prompt = [1] * 10
    assert space.admission_cost(prompt, 9, 11, 3) == 6 + 1 + 2
    assert space.admission_cost(prompt, 9, 11, 3, partial=False) == 6 + 2
    assert space.admission_cost([2] * 10, 9, 11, 3) == 6 + 2
    b = seq(prompt)
    assert space.admit(b, prompt, 9, partial=False) == 0 and b.copy is None and b.table == []


def test_share_false_copies_nothing() -> None:
    space = BlockSpace(8, 2, share=False)
    a = computed_seq(space, [1, 2, 3])
    space.release(a, a.tokens, keep=True)
    b = seq([1, 2, 3, 4])
    assert space.admit(b, b.tokens, 3) == 0 and b.copy is None and space.n_cached == 0


# ----------------------------------------------------------------------------- admission cost


@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("prompt_len", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("cached", ["none", "in use", "unused"])
def test_admission_cost_is_what_admission_prefill_fork_and_a_first_decode_take(
        n: int, prompt_len: int, cached: str, partial: bool) -> None:
    """The scheduler asks for the cost of a prompt prefilled to `target + 1` positions: the
    prompt and the first output token of each choice. Play that out and count (with and
    without a copy of a partly matching block, whose source is held until the copy)."""
    space = BlockSpace(32, 2)
    prompt = list(range(1, prompt_len + 1))
    running = []
    if cached != "none":
        other = computed_seq(space, prompt + [99])
        if cached == "unused":
            space.release(other, other.tokens, keep=True)
        else:
            running.append(other)
    free = space.n_free
    limit = prompt_len - 1
    cost = space.admission_cost(prompt, limit, prompt_len + 1, n, partial)
    first = seq(prompt)
    first.computed = space.admit(first, prompt, limit, partial)
    assert (first.copy is not None) == (partial and cached != "none" and limit % 2 == 1)
    assert space.grow(first, prompt_len)
    first.computed = prompt_len
    space.commit(first, first.tokens, prompt_len)
    children = [seq(prompt) for _ in range(n - 1)]
    for c in children:
        space.fork(first, c, prompt_len)
    for s in [first, *children]:
        s.output_ids.append(0)
        assert space.grow(s, prompt_len + 1)  # the first decode's position
    assert cost == free - space.n_free
    check(space, running + [first, *children])
