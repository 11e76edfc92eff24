"""The merges a sentencepiece GGUF vocabulary implies (loading/gguf.py `_sentencepiece_merges`):
found with numpy hashes (Gemma 3's 262,144 pieces have 514,847 merges: a Python lookup per
split took most of its tokenizer's build), the same list as the plain definition, in the same
order; where the hashes cannot be exact, by lookups."""

from __future__ import annotations

import random

import pytest
from gguf import TokenType

from nbserve.loading import gguf as loader

NORMAL, CONTROL, UNUSED, USER = (TokenType.NORMAL, TokenType.CONTROL, TokenType.UNUSED,
                                 TokenType.USER_DEFINED)


def plain_merges(tokens, scores, types):
    """The definition, one split at a time: (score desc, left id, right id)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    found = []
    for i, (piece, ty) in enumerate(zip(tokens, types)):
        if ty not in (NORMAL, USER) or vocab[piece] != i:
            continue
        for k in range(1, len(piece)):
            left, right = vocab.get(piece[:k]), vocab.get(piece[k:])
            if left is not None and right is not None:
                found.append((-scores[i], left, right))
    return [(tokens[left], tokens[right]) for _, left, right in sorted(found)]


def vocabulary(seed: int, size: int = 3000) -> tuple[list[str], list[float], list[int]]:
    """Pieces grown from an alphabet with a space marker, accents and emoji, and pieces with
    a NUL inside; some written twice, some control or unused, scores with ties."""
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "é", "\u2581", "😀", "中", "z", "\x00b", "a\x00b"]
    tokens = list(dict.fromkeys(alphabet))
    while len(tokens) < size:
        a, b = rng.choice(tokens), rng.choice(tokens)
        tokens.append(a + b if len(a + b) < 12 else a)
    types = [rng.choice([NORMAL] * 8 + [CONTROL, UNUSED, USER]) for _ in tokens]
    scores = [float(-rng.randrange(400)) for _ in tokens]
    return tokens, scores, types


def merges(tokens, scores, types):
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))
    return loader._sentencepiece_merges(tokens, vocab, scores, types)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merges_are_the_plain_definitions_in_its_order_found_with_hashes(seed, monkeypatch):
    tokens, scores, types = vocabulary(seed)
    assert len(set(tokens)) < len(tokens)  # some piece is written twice

    def no_lookups(*args):
        raise AssertionError("the hashed splits should serve this vocabulary")

    monkeypatch.setattr(loader, "_split_ids_by_lookup", no_lookups)
    expected = plain_merges(tokens, scores, types)
    assert len(expected) > 100
    assert merges(tokens, scores, types) == expected


def test_colliding_hashes_and_trailing_nuls_fall_back_to_lookups(monkeypatch):
    tokens, scores, types = vocabulary(3)
    expected = plain_merges(tokens, scores, types)
    monkeypatch.setattr(loader, "_HASH_BASE", 1)  # every anagram collides
    monkeypatch.setattr(loader, "_HASH_MIX", 1)
    assert loader._split_ids(tokens, *_lengths_and_all(tokens)) is None
    assert merges(tokens, scores, types) == expected
    monkeypatch.undo()
    with_nul = [*tokens, "ab\x00"]  # numpy's strings drop a trailing NUL
    more = (scores + [0.0], types + [NORMAL])
    assert loader._split_ids(with_nul, *_lengths_and_all(with_nul)) is None
    assert merges(with_nul, *more) == plain_merges(with_nul, *more)


def test_no_scores_rank_by_id_and_a_vocabulary_without_merges_has_none():
    tokens = ["a", "b", "ab", "ba", "aba"]
    types = [NORMAL] * 5
    by_id = [-float(i) for i in range(5)]
    assert merges(tokens, None, types) == plain_merges(tokens, by_id, types)
    assert merges(["a", "b"], None, [NORMAL] * 2) == []


def _lengths_and_all(tokens):
    import numpy as np

    lengths = np.array([len(t) for t in tokens])
    return lengths, np.arange(len(tokens))[lengths > 1]
