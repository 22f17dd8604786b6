"""KV-cache block bookkeeping: which request owns which blocks, and the prefix cache.

Pure Python; never touches device memory (the model runner owns the tensors).

Each block is in exactly one of three states:

    free    ref_count == 0, no hash          in the free queue
    cached  ref_count == 0, hash set         in the free queue AND in the hash map (reusable until evicted)
    in use  ref_count >= 1                   held by one or more requests' block tables (or a session's)

The free queue is an LRU in O(1): blocks are appended when their last owner lets go and taken
from the front, so the least recently used cached block is evicted first. A cache hit takes a
block out of the queue wherever it is (OrderedDict.pop is O(1)).

Full blocks are hashed as a chain: hash(previous block's hash, this block's token ids), so
one lookup per block finds the longest cached prefix; a hit also compares the token ids,
so a hash collision can never serve another prompt's KV.

Parallel sampling (n > 1) shares a prompt without the prefix cache: `fork` hands a sibling the
first sequence's computed full prompt blocks, which `allocate` takes by reference (ref_count + 1,
no copy), exactly as it takes cached-prefix blocks.

Sessions (engine/sessions.py) keep a finished request's table under the session's id instead of freeing
it (`hold`): the ref counts stay, only the owner changes. The next turn takes those blocks by reference
through `allocate`, then the session lets go of its own references (`release_held`), so the blocks move
without ever being free. A held table counts as an owner in `check_invariants`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmserve.engine.request import Request

BlockHash = tuple[int, tuple[int, ...]]  # (hash of the chain, this block's token ids)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True)
class KVCacheUsage:
    total: int
    free: int  # never used or evicted: no reusable content
    cached: int  # unowned but holding a reusable prefix
    in_use: int


@dataclass
class PrefixStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}  # request id -> block ids in order
        self._hashes: dict[str, list[BlockHash]] = {}  # request id -> hashes of its full blocks
        # request id -> leading blocks of its table that cache_full_blocks has already looked at: each step looks
        # at the new ones only, not the whole table (at 64 requests of 2,000 tokens in 16-token blocks, looking at
        # every block took ~3 ms of each step)
        self._published: dict[str, int] = {}
        self._held: dict[str, list[int]] = {}  # session id -> block ids a session holds between turns
        self.prefix_stats = PrefixStats()

    # --- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> KVCacheUsage:
        cached = sum(1 for b in self._free if self.blocks[b].block_hash is not None)
        return KVCacheUsage(self.num_blocks, len(self._free) - cached, cached, self.num_blocks - len(self._free))

    # --- prefix cache --------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens (full blocks only).

        The last token is never served from the cache, so the step that finishes the prompt
        always computes at least one token and produces logits.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        hashes = self._chain_hashes(request, num_full)
        hits = []
        for h in hashes[:num_full]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _chain_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        known = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(known) < num_full_blocks:
            i = len(known)
            parent = hash(known[-1]) if known else hash(("root", request.cache_salt))
            tokens = tuple(request.key_ids(i * bs, (i + 1) * bs))
            known.append((parent, tokens))
        return known  # at least num_full_blocks long (longer if an earlier call asked for more)

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full and computed, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._chain_hashes(request, num_full)
        for i in range(start, num_full):
            block, h = self.blocks[table[i]], hashes[i]
            # a block whose content another block already publishes stays unpublished (as before, when every
            # call looked again: now it is not looked at again if that other block is later evicted)
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = table[i]
        self._published[request.request_id] = num_full

    # --- parallel sampling ---------------------------------------------------------------

    def num_shareable_blocks(self, request: Request) -> int:
        """Full prompt blocks a sibling can share: never the one holding the last prompt token, which
        the request computes itself so that the step yields its logits (as with a prefix hit)."""
        return (request.num_prompt_tokens - 1) // self.block_size

    def fork(self, source: Request, num_full_blocks: int) -> list[int]:
        """The first num_full_blocks of the source's table, for a request with the same prompt to pass to
        allocate() as its prefix. The blocks must already hold computed K/V: they are shared, never copied."""
        table = self._tables.get(source.request_id, [])
        assert num_full_blocks <= len(table), "fork of blocks the source does not hold"
        assert num_full_blocks * self.block_size <= source.num_computed_tokens, "fork of uncomputed blocks"
        return table[:num_full_blocks]

    def fork_beam(self, parent: Request, child: Request) -> tuple[int, int] | None | bool:
        """Give `child` (a beam forked from `parent`, same tokens so far) the parent's computed K/V:
        full blocks by reference, the partial last block copied on write.

        Returns the (source, destination) block pair the runner must copy, None when nothing needs
        copying, or False when the pool has no block for the copy: the child then shares the full
        blocks only and its num_computed_tokens is cut back to them (it recomputes the tail)."""
        assert child.request_id not in self._tables
        table = self._tables.get(parent.request_id, [])
        num_computed = child.num_computed_tokens
        num_full = min(num_computed // self.block_size, len(table))
        shared = table[:num_full]
        for block_id in shared:
            self._take(block_id)
        self._tables[child.request_id] = list(shared)
        if num_computed == num_full * self.block_size:
            return None
        if not self._free:
            child.num_computed_tokens = num_full * self.block_size
            return False
        copy = self._take_free()
        self._tables[child.request_id].append(copy)
        return table[num_full], copy

    # --- sessions ------------------------------------------------------------------------

    def hold(self, request: Request, session_id: str) -> None:
        """Keep a finished request's blocks under `session_id` instead of freeing them (ref counts
        unchanged). Only the blocks holding computed tokens are kept; the rest (a block allocated for
        the last sampled token or for draft tokens) is released."""
        assert session_id not in self._held, "release the session's old blocks first"
        table = self._tables.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self._published.pop(request.request_id, None)
        keep = self.blocks_needed(request.num_computed_tokens)
        self._release(table[keep:])
        self._held[session_id] = table[:keep]

    def held_table(self, session_id: str) -> list[int]:
        return self._held.get(session_id, [])

    @property
    def num_held_blocks(self) -> int:
        return sum(len(t) for t in self._held.values())

    def trim_held(self, session_id: str, num_blocks: int) -> None:
        """Release a held table's blocks past the first num_blocks."""
        table = self._held.get(session_id, [])
        self._release(table[num_blocks:])
        del table[num_blocks:]

    def release_held(self, session_id: str) -> None:
        """The session lets go of its blocks (through the normal path: hashed ones stay cached)."""
        self._release(self._held.pop(session_id, []))

    def writable_in_place(self, block_id: int) -> bool:
        """True when new K/V may overwrite the block's later slots: nobody else holds it and the prefix
        cache does not promise its content (a hashed block must keep the tokens of its hash)."""
        block = self.blocks[block_id]
        return block.ref_count == 1 and block.block_hash is None

    # --- allocation ----------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[int] | None = None,
                 num_prefix_tokens: int | None = None) -> bool:
        """Make room for request.num_computed_tokens + num_new_tokens tokens; False (and no change) if
        the pool cannot. `cached_prefix` (from find_cached_prefix, fork or a session) is taken first, by
        reference, on a fresh request; it holds `num_prefix_tokens` computed tokens (default: every
        block full; a session's prefix may end inside its last block)."""
        table = self._tables.setdefault(request.request_id, [])
        cached_prefix = cached_prefix or []
        assert not (cached_prefix and table), "a cached prefix is only taken by a request without blocks"
        have = len(table) + len(cached_prefix)
        if num_prefix_tokens is None:
            num_prefix_tokens = len(cached_prefix) * self.block_size
        num_computed = request.num_computed_tokens + num_prefix_tokens
        need = self.blocks_needed(num_computed + num_new_tokens) - have
        # Cached blocks sitting in the free queue stop being free when we take them.
        reclaimed = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        if need > len(self._free) - reclaimed:
            if not table:
                del self._tables[request.request_id]
            return False
        for block_id in cached_prefix:
            self._take(block_id)
            table.append(block_id)
        for _ in range(max(need, 0)):
            table.append(self._take_free())
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks. Called on finish, abort and preemption; idempotent."""
        table = self._tables.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self._published.pop(request.request_id, None)
        self._release(table)

    def _release(self, table: list[int]) -> None:
        # Release the tail first so that, among equally old blocks, a prefix's later blocks are
        # evicted before its earlier ones (an earlier block is useful without the later ones).
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self._free[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def reset_prefix_cache(self) -> None:
        for block_id in self._free:
            self.blocks[block_id].block_hash = None
        self._cached = {h: b for h, b in self._cached.items() if self.blocks[b].ref_count > 0}

    # --- integrity -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """free + cached + in use == total; ref counts equal the number of tables (requests' and
        sessions') holding a block."""
        refs = [0] * self.num_blocks
        for table in [*self._tables.values(), *self._held.values()]:
            for b in table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref_count mismatch"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"block {block.block_id}: queue mismatch"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks)
        usage = self.usage()
        assert usage.free + usage.cached + usage.in_use == usage.total
