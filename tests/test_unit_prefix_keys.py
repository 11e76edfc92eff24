"""Prefix-cache keys cannot be forged: a block's key is a keyed 128-bit hash of its parent's key
and its tokens, so a prompt whose blocks collide under Python's hash() never reads another
prompt's cached keys and values."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

from nbserve.engine.blocks import ROOT_KEY, BlockSpace, block_key

BS = 2
M = sys.hash_info.modulus  # hash(k) == hash(k + M) for a non-negative int k


def seq() -> Any:
    return SimpleNamespace(table=[], keyed=0, last_key=ROOT_KEY, copy=None)


def run(space: BlockSpace, tokens: list[int]) -> Any:
    """Admit, compute and finish one sequence (its blocks stay cached)."""
    s = seq()
    space.admit(s, tokens, len(tokens) - 1)
    assert space.grow(s, len(tokens))
    space.commit(s, tokens, len(tokens))
    space.release(s, tokens, keep=True)
    return s


def test_a_prompt_that_collides_under_python_hash_does_not_get_another_prompts_blocks() -> None:
    """The secret (5, 7) and the forged (5, 7 + M) are one tuple under hash(). With keys made by
    hash(), the victim's first block was refused (its twin key taken), but its second block was
    keyed under the forged one's key: a prompt of the forged block and the victim's second
    block got that second block, whose keys and values attend to the victim's secret."""
    secret, forged, follow = [5, 7], [5, 7 + M], [11, 13]
    assert hash(tuple(secret)) == hash(tuple(forged))
    space = BlockSpace(16, BS)
    run(space, forged + [1])  # the attacker's block is cached first
    victim = seq()
    prompt = secret + follow + [2]
    space.admit(victim, prompt, len(prompt) - 1)
    assert space.grow(victim, len(prompt))
    space.commit(victim, prompt, len(prompt))
    victims_second = victim.table[1]
    attacker = seq()
    probe = forged + follow + [3]
    cached = space.admit(attacker, probe, len(probe) - 1)
    assert victims_second not in attacker.table
    assert cached == BS  # its own first block only


def test_the_key_depends_on_the_parent_and_every_token() -> None:
    tokens = list(range(100, 116))
    key = block_key(ROOT_KEY, tokens)
    assert isinstance(key, bytes) and len(key) >= 16
    assert block_key(ROOT_KEY, tuple(tokens)) == key  # equal input, equal key
    assert block_key(key, tokens) != key
    assert block_key(block_key(ROOT_KEY, [1] * 16), tokens) != key
    for i in range(len(tokens)):
        changed = list(tokens)
        changed[i] += 1
        assert block_key(ROOT_KEY, changed) != key, i
        assert block_key(ROOT_KEY, changed[:i] + [tokens[i] + M] + tokens[i + 1:]) != key, i
    assert block_key(ROOT_KEY, tokens[:-1]) != key
    assert len({block_key(ROOT_KEY, [t]) for t in range(10_000)}) == 10_000


def test_a_chain_with_another_first_block_never_shares_the_later_ones() -> None:
    space = BlockSpace(32, BS)
    run(space, [1, 2, 3, 4, 5, 6, 0])
    other = seq()
    assert space.admit(other, [9, 2, 3, 4, 5, 6, 0], 6) == 0
    same = seq()
    assert space.admit(same, [1, 2, 3, 4, 5, 6, 0], 6) == 6
