"""KV space: which cache blocks each sequence's keys and values live in, and which blocks of
finished or running sequences can be shared by a new one.

Pure Python, no torch. Two implementations of one interface (`KVSpace`), chosen by the model:

- `BlockSpace`, for models with a paged cache: fixed-size blocks from one pool, a block table
  per sequence, full blocks identified by a hash chain over their tokens (a block's key is a
  keyed 128-bit hash of its tokens and its parent's key, `prefix_keys.py`: equal keys mean
  equal prefixes, even for a prompt crafted to collide) and shared, reference-
  counted, between sequences. Blocks nobody uses keep their contents and their key, and are
  reused least-recently-used first when the pool needs room: a later turn of a chat, the
  sixteenth user of one system prompt, the n choices of one request prefill only what is new.
  Past the last shared block, a prompt that agrees with part of a cached block (a full one, or
  the partly filled last block of a finished sequence) gets a copy of those positions in a
  block of its own, so reuse is as fine as one token, like llama-server's slots and SGLang's
  radix cache, while sharing stays by whole blocks.
  A new block comes from the blocks that have held contents before (a freed one; then, past
  `retain` cached blocks, the least recently used cached one) before a never-used one: on
  CPU, where the cache is committed page by page, the resident part of it grows with what the
  traffic holds at once plus the cached prefixes kept, not with how many distinct prompts it
  has seen. `give_back` then hands the engine the freed blocks of an idle server, whose pages
  the cache returns to the system.
- `SlotSpace`, for models with the older one-row-per-sequence cache (`make_cache`): one
  "block" of `max_context` tokens per sequence; a free row remembers its tokens, and a new
  prompt takes the free row that shares its longest prefix.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Protocol

from .prefix_keys import ROOT_KEY, block_key

# cached blocks compared with a prompt's partly matching block, the newest first: enough for
# the variants of one system prompt a server sees; bounded so that admission stays cheap
PARTIAL_CANDIDATES = 32


class BlockHolder(Protocol):
    """What a space reads and writes of a sequence (`scheduler.Sequence`): its block table,
    how many of its leading blocks have known keys, the last of those keys, and the copy
    `admit` left for it."""

    table: list[int]
    keyed: int
    last_key: bytes
    root: bytes  # the key its chain starts from: ROOT_KEY, or its LoRA adapter's own
    copy: tuple[int, int, int] | None


class KVSpace(Protocol):
    """What the scheduler asks of the cache's bookkeeping. A sequence's `table` lists its
    blocks in order; position p lives in block table[p // block_size]."""

    block_size: int
    n_blocks: int
    reserve: int  # free blocks admission leaves for the growth of running sequences

    @property
    def n_free(self) -> int:
        """Blocks a new allocation can take (never-used, freed, or cached but unused)."""

    @property
    def n_used(self) -> int:
        """Blocks held by running sequences."""

    @property
    def n_cached(self) -> int:
        """Blocks nobody runs that keep a reusable prefix."""

    @property
    def n_touched(self) -> int:
        """Blocks that hold, or have held since their pages were last given back, keys and
        values: on CPU, where the cache is committed lazily, the part of it that is resident."""

    def give_back(self, reach: int) -> list[tuple[int, int]]:
        """The freed blocks (no holder, no cached contents), now counted as never used: as
        runs [start, end) of blocks that hold nothing, each run widened by up to `reach`
        never-used neighbours on either side (so that pages shared with them count too). The
        caller returns their memory; a later `grow` or `admit` may hand them out again."""

    def admit(self, seq: BlockHolder, tokens: list[int], limit: int, partial: bool = True,
              root: bytes = ROOT_KEY) -> int:
        """Give `seq` the cached blocks of the longest prefix of `tokens[:limit]` that the
        space holds; return how many tokens that covers (their keys/values are ready once
        the copy it may leave in `seq.copy` is made: see `take_copy`). `partial`: whether a
        block that agrees with only part of what follows may be copied (its source is held
        until then, which can cost a block: see `admission_cost`). `root`: the key chains
        start from (a LoRA adapter's own: its keys and values are never shared with others)."""

    def take_copy(self, seq: BlockHolder) -> tuple[int, int, int] | None:
        """The copy `admit` left for `seq` (src block, dst block, positions), now to be made
        before anything else writes to the cache; its source is no longer held for it."""

    def cached_prefix(self, tokens: list[int], limit: int, root: bytes = ROOT_KEY
                      ) -> tuple[int, int]:
        """(tokens of `tokens[:limit]` cached, how many of those blocks are unused): no change."""

    def admission_cost(self, tokens: list[int], limit: int, length: int, n: int,
                       partial: bool = True, root: bytes = ROOT_KEY) -> int:
        """Free blocks that admitting `n` choices of `tokens` would use, prefilled to `length`
        positions, with the prefix of `tokens[:limit]` that is cached taken from the cache
        (`partial` as for `admit`: without it, a request that fits the pool never waits for
        the block a copy's source would hold)."""

    def grow(self, seq: BlockHolder, length: int) -> bool:
        """Make `seq.table` cover positions < `length`; False (and no change) if the pool
        lacks the blocks."""

    def commit(self, seq: BlockHolder, tokens: list[int], computed: int) -> None:
        """`seq`'s first `computed` positions now hold `tokens`' keys/values: share the full
        blocks among them."""

    def fork(self, parent: BlockHolder, child: BlockHolder, computed: int
             ) -> tuple[int, int, int] | None:
        """Give `child` the parent's first `computed` positions: the full blocks shared, the
        partial one copied. Returns the copy to make (src block, dst block, positions), or
        None when there is none; raises MemoryError when no block is free for it."""

    def release(self, seq: BlockHolder, tokens: list[int], keep: bool) -> None:
        """`seq` ended: return its blocks. `keep`: their cached contents stay valid."""


class BlockSpace:
    """A pool of `n_blocks` blocks of `block_size` positions, shared by hash chain. Up to
    `retain` cached blocks are kept before a new block evicts one (while never-used blocks
    remain): enough for a few conversations' prefixes, however many distinct prompts come."""

    def __init__(self, n_blocks: int, block_size: int, share: bool = True, retain: int = 0):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one position, got {n_blocks} x "
                             f"{block_size}")
        if not 0 <= retain <= n_blocks:
            raise ValueError(f"retain must be between 0 and n_blocks={n_blocks}, got {retain}")
        self.n_blocks, self.block_size, self.share = n_blocks, block_size, share
        self.retain = retain
        self.reserve = max(1, n_blocks // 100)  # kept free for running sequences' growth
        self.refs = [0] * n_blocks
        # freed blocks without a key (their pages resident): taken first, the last freed first
        self._free: list[int] = []
        # never-used blocks (or given back), a heap: low ids first, so that a lightly used
        # server touches (and keeps resident) only the start of its cache
        self._fresh = list(range(n_blocks))
        self._unused: OrderedDict[int, None] = OrderedDict()  # keyed, refs 0: oldest first
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        # block -> (parent key, tokens): keyed full blocks, and the partly filled last blocks
        # of finished sequences (no key; found only through `_under`)
        self._content: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        # (parent key, first token) -> blocks with contents under that parent, newest last
        self._under: dict[tuple[bytes, int], dict[int, None]] = {}
        self.evictions = 0
        self._touched = bytearray(n_blocks)
        self.n_touched = 0

    # ---------------------------------------------------------------- counts

    @property
    def n_free(self) -> int:
        return len(self._free) + len(self._fresh) + len(self._unused)

    @property
    def n_used(self) -> int:
        """Blocks held by at least one running sequence."""
        return self.n_blocks - self.n_free

    @property
    def n_cached(self) -> int:
        """Blocks that hold a shareable prefix nobody runs now (reusable, or evicted)."""
        return len(self._unused)

    @property
    def n_keyed(self) -> int:
        """Blocks with a key: shareable now (in use, or cached)."""
        return len(self._key_of)

    # ---------------------------------------------------------------- lookups

    def _walk(self, tokens: list[int], limit: int, root: bytes) -> list[int]:
        """The cached blocks of the longest keyed prefix of tokens[:limit], from `root`."""
        if not self.share:
            return []
        bs, parent, found = self.block_size, root, []
        for start in range(0, limit - bs + 1, bs):
            chunk = tuple(tokens[start:start + bs])
            key = block_key(parent, chunk)
            block = self._by_key.get(key)
            if block is None or self._content.get(block) != (parent, chunk):
                break
            found.append(block)
            parent = key
        return found

    def _partial(self, tokens: list[int], limit: int, blocks: list[int], root: bytes
                 ) -> tuple[int, int]:
        """After the shared `blocks`: the cached block that agrees longest with the tokens
        that follow them (up to `limit`), and for how many positions; (-1, 0) if none."""
        bs = self.block_size
        start = len(blocks) * bs
        want = tokens[start:min(limit, start + bs - 1)]  # a whole block would be shared
        if not self.share or not want:
            return -1, 0
        parent = self._key_of[blocks[-1]] if blocks else root
        under = self._under.get((parent, want[0]))
        best, best_n = -1, 0
        for looked, block in enumerate(reversed(under or {})):  # the newest first
            if looked == PARTIAL_CANDIDATES:
                break
            n = common_prefix_len(list(self._content[block][1]), want)
            if n > best_n:
                best, best_n = block, n
                if n == len(want):
                    break
        return best, best_n

    def cached_prefix(self, tokens: list[int], limit: int, root: bytes = ROOT_KEY
                      ) -> tuple[int, int]:
        limit = min(limit, len(tokens))
        blocks = self._walk(tokens, limit, root)
        src, n = self._partial(tokens, limit, blocks, root)
        return (len(blocks) * self.block_size + n,
                sum(self.refs[b] == 0 for b in blocks) + (n > 0 and self.refs[src] == 0))

    def admission_cost(self, tokens: list[int], limit: int, length: int, n: int,
                       partial: bool = True, root: bytes = ROOT_KEY) -> int:
        limit = min(limit, len(tokens))
        blocks = self._walk(tokens, limit, root)
        src, copied = self._partial(tokens, limit, blocks, root) if partial else (-1, 0)
        # a partly matching block is held until its positions are copied (then let go)
        unused = sum(self.refs[b] == 0 for b in blocks) + (copied > 0 and self.refs[src] == 0)
        # each other choice shares the prompt's full blocks and needs one of its own: the
        # copy of the partial last block (which holds its first decode's position too), or,
        # when the prompt ends on a block boundary, the block its first decode opens
        return -(-length // self.block_size) - len(blocks) + unused + (n - 1)

    # ---------------------------------------------------------------- changes

    def admit(self, seq: BlockHolder, tokens: list[int], limit: int, partial: bool = True,
              root: bytes = ROOT_KEY) -> int:
        limit = min(limit, len(tokens))
        blocks = self._walk(tokens, limit, root)
        for b in blocks:
            self._ref(b)
        seq.table = list(blocks)
        seq.keyed = len(blocks)
        seq.last_key = self._key_of[blocks[-1]] if blocks else root
        src, n = self._partial(tokens, limit, blocks, root) if partial else (-1, 0)
        if n and self.n_free > (self.refs[src] == 0):  # room for the copy besides its source
            self._ref(src)  # held until the copy is made: not evicted before it
            seq.table.append(self._take())
            seq.copy = (src, seq.table[-1], n)
        return len(blocks) * self.block_size + (n if seq.copy else 0)

    def take_copy(self, seq: BlockHolder) -> tuple[int, int, int] | None:
        copy = seq.copy
        if copy is not None:
            seq.copy = None
            self._unref(copy[0], keep=True)
        return copy

    def grow(self, seq: BlockHolder, length: int) -> bool:
        need = -(-length // self.block_size) - len(seq.table)
        if need <= 0:
            return True
        if need > self.n_free:
            return False
        seq.table.extend(self._take() for _ in range(need))
        return True

    def commit(self, seq: BlockHolder, tokens: list[int], computed: int) -> None:
        if not self.share:
            return
        bs = self.block_size
        while (seq.keyed + 1) * bs <= computed:
            i = seq.keyed
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = block_key(seq.last_key, chunk)
            block = seq.table[i]
            if block not in self._key_of and key not in self._by_key:  # else: a twin exists
                self._by_key[key], self._key_of[block] = block, key
                self._remember(block, seq.last_key, chunk)
            seq.keyed, seq.last_key = i + 1, key

    def fork(self, parent: BlockHolder, child: BlockHolder, computed: int
             ) -> tuple[int, int, int] | None:
        full, rest = divmod(computed, self.block_size)
        if rest and not self.n_free:
            raise MemoryError("no free KV block for a choice's copy of the prompt's last block")
        child.table = list(parent.table[:full])
        for b in child.table:
            self._ref(b)
        child.keyed, child.last_key = parent.keyed, parent.last_key  # keyed blocks are full
        if not rest:
            return None
        dst = self._take()
        child.table.append(dst)
        return parent.table[full], dst, rest

    def release(self, seq: BlockHolder, tokens: list[int], keep: bool) -> None:
        if self.take_copy(seq) is None and keep:  # (a copy never made leaves no tail to keep)
            self._keep_tail(seq, tokens)
        # last block first: the LRU then evicts a chain from its tail (evicting its head
        # would leave the rest unreachable), and freed low ids are handed out again first
        for b in reversed(seq.table):
            self._unref(b, keep)
        seq.table = []
        seq.keyed, seq.last_key = 0, ROOT_KEY

    # ---------------------------------------------------------------- internals

    def _keep_tail(self, seq: BlockHolder, tokens: list[int]) -> None:
        """Remember what the partly filled last block of a finished `seq` holds, so that a
        prompt continuing from there (the next turn of its chat) can copy it."""
        full, rest = divmod(len(tokens), self.block_size)
        if not (self.share and rest and seq.keyed == full and len(seq.table) > full):
            return
        block = seq.table[full]
        if self.refs[block] == 1 and block not in self._content:
            self._remember(block, seq.last_key, tuple(tokens[full * self.block_size:]))

    def _remember(self, block: int, parent: bytes, tokens: tuple[int, ...]) -> None:
        self._content[block] = (parent, tokens)
        self._under.setdefault((parent, tokens[0]), {})[block] = None

    def _unref(self, block: int, keep: bool) -> None:
        """One holder less; a block nobody holds is cached if it keeps contents, else freed."""
        self.refs[block] -= 1
        assert self.refs[block] >= 0, f"block {block} released more often than taken"
        if self.refs[block]:
            return
        if keep and block in self._content:
            self._unused[block] = None  # newest last
        else:
            self._forget(block)
            self._free.append(block)

    def _ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self._unused.pop(block, None)
        self.refs[block] += 1

    def _take(self) -> int:
        """A block for new contents: a freed one first; then, once `retain` blocks are cached
        (or no never-used one is left), the least recently used cached one (its key is
        dropped); else a never-used one (it adds to the resident pages)."""
        if self._free:
            block = self._free.pop()
        elif self._unused and (len(self._unused) >= self.retain or not self._fresh):
            block, _ = self._unused.popitem(last=False)
            self._forget(block)
            self.evictions += 1
        else:
            block = heapq.heappop(self._fresh)
            self._touched[block] = 1
            self.n_touched += 1
        self.refs[block] = 1
        return block

    def give_back(self, reach: int) -> list[tuple[int, int]]:
        freed, self._free = sorted(self._free), []
        if not freed:
            return []
        touched = self._touched
        for b in freed:
            touched[b] = 0
            heapq.heappush(self._fresh, b)
        self.n_touched -= len(freed)
        was_freed = set(freed)
        runs: list[tuple[int, int]] = []
        for b in freed:
            if runs and b < runs[-1][1]:
                continue  # inside the run before
            start = b
            while start > 0 and b - start < reach and not touched[start - 1]:
                start -= 1
            end, last = b + 1, b  # last: the run's last freed block
            while end < self.n_blocks and not touched[end] and \
                    (end in was_freed or end - last <= reach):
                last = end if end in was_freed else last
                end += 1
            if runs and start <= runs[-1][1]:
                start = runs.pop()[0]
            runs.append((start, end))
        return runs

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None and self._by_key.get(key) == block:
            del self._by_key[key]
        content = self._content.pop(block, None)
        if content is not None:
            parent, tokens = content
            under = self._under[(parent, tokens[0])]
            del under[block]
            if not under:
                del self._under[(parent, tokens[0])]


class SlotSpace:
    """One block of `max_context` positions per sequence, for models whose cache is one row
    per sequence (`make_cache(max_batch, max_context)`); nothing is shared between running
    sequences, and a free row remembers its tokens for the next prompt that starts with them."""

    def __init__(self, n_slots: int, max_context: int):
        self.n_blocks, self.block_size = n_slots, max_context
        self.reserve = 0  # a running sequence never needs a second row
        self._free: set[int] = set(range(n_slots))
        self._cached: list[list[int]] = [[] for _ in range(n_slots)]
        self._roots: list[bytes] = [ROOT_KEY] * n_slots  # whose keys and values each row holds
        self._last_used = [0] * n_slots
        self._clock = 0
        self.evictions = 0
        self._touched: set[int] = set()

    @property
    def n_touched(self) -> int:
        """Rows that have ever held a sequence."""
        return len(self._touched)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free)

    @property
    def n_cached(self) -> int:
        """Free rows that remember a prefix. Read from the /stats thread too: the set is
        copied in one C call (atomic under the GIL) before it is counted."""
        return sum(1 for s in tuple(self._free) if self._cached[s])

    n_keyed = n_cached

    def _best(self, tokens: list[int], limit: int, root: bytes = ROOT_KEY) -> tuple[int, int]:
        best, best_len = -1, -1
        for s in sorted(self._free):
            n = min(common_prefix_len(self._cached[s], tokens), limit) \
                if self._roots[s] == root else 0
            if n > best_len or (n == best_len and self._last_used[s] < self._last_used[best]):
                best, best_len = s, n
        return best, max(best_len, 0)

    def cached_prefix(self, tokens: list[int], limit: int, root: bytes = ROOT_KEY
                      ) -> tuple[int, int]:
        if not self._free:
            return 0, 0
        _, n = self._best(tokens, limit, root)
        return n, 1 if n else 0

    def admission_cost(self, tokens: list[int], limit: int, length: int, n: int,
                       partial: bool = True, root: bytes = ROOT_KEY) -> int:
        return n

    def admit(self, seq: BlockHolder, tokens: list[int], limit: int, partial: bool = True,
              root: bytes = ROOT_KEY) -> int:
        slot, n = self._best(tokens, limit, root)
        self._take(slot)
        seq.table = [slot]
        return n

    def grow(self, seq: BlockHolder, length: int) -> bool:
        if seq.table:
            return length <= self.block_size
        if not self._free:
            return False
        slot, _ = self._best([], 0)
        self._take(slot)
        seq.table = [slot]
        return True

    def _take(self, slot: int) -> None:
        self._free.discard(slot)
        self._cached[slot] = []
        self._touched.add(slot)

    def commit(self, seq: BlockHolder, tokens: list[int], computed: int) -> None:
        pass

    def give_back(self, reach: int) -> list[tuple[int, int]]:
        return []  # a row keeps the prefix it remembers: nothing is freed without contents

    def take_copy(self, seq: BlockHolder) -> tuple[int, int, int] | None:
        return None  # a row's cached prefix is in place: nothing to copy

    def fork(self, parent: BlockHolder, child: BlockHolder, computed: int
             ) -> tuple[int, int, int] | None:
        if not self.grow(child, computed):
            raise MemoryError("no free cache row for a choice of this request")
        return (parent.table[0], child.table[0], computed) if computed else None

    def release(self, seq: BlockHolder, tokens: list[int], keep: bool) -> None:
        if not seq.table:
            return
        slot = seq.table[0]
        self._clock += 1
        self._cached[slot] = tokens if keep else []
        self._roots[slot] = seq.root
        self._last_used[slot] = self._clock
        self._free.add(slot)
        seq.table = []


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the shared prefix of two token lists (compares 64-token blocks first)."""
    n, i = min(len(a), len(b)), 0
    while i + 64 <= n and a[i:i + 64] == b[i:i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i
