"""Keys of the prefix cache's blocks: a block is found by a hash chain over its tokens, and
sharing it is safe only if no other prefix can have its key. Each key is a 128-bit BLAKE2b,
keyed with a secret of this process, of the parent block's key and the block's tokens.

Python's hash() of a tuple, used before, is neither keyed nor collision-resistant (hash(k) ==
hash(k + sys.hash_info.modulus), and its steps are invertible): a prompt crafted to collide
with another could be given the blocks that follow it, whose keys and values attend to the
other prompt's tokens (the class of vLLM's prefix-cache advisory, fixed there by SHA-256).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Callable, Sequence

ROOT_KEY = bytes(16)  # the parent key of a sequence's first block

# Made once (the key schedule is the costly part), then copied for each block.
_KEYED = hashlib.blake2b(digest_size=16, key=secrets.token_bytes(32))
# A packer of n 64-bit integers per block length n (one length per cache): faster than array.
_PACKERS: dict[int, Callable[..., bytes]] = {}


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its tokens (as 64-bit integers) under its parent's key."""
    pack = _PACKERS.get(len(tokens))
    if pack is None:
        pack = _PACKERS[len(tokens)] = struct.Struct(f"<{len(tokens)}q").pack
    h = _KEYED.copy()
    h.update(parent + pack(*tokens))
    return h.digest()
