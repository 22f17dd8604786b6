"""Stateful sessions: a conversation's KV kept between turns, so the next turn prefills only its new tokens.

Life of a session (LMDeploy's `session_id`, SGLang's open/close sessions):

1. A request carrying a session id finishes (stop or length, never abort): instead of freeing its
   blocks, the KV-cache manager keeps them under the session id (`KVCacheManager.hold`, ref counts
   unchanged) and the session records the token ids those blocks hold: exactly the computed ones
   (the last sampled token usually has no K/V yet).
2. The next request with that id reaches the head of the queue: the longest common prefix of the
   session's tokens and its own (at most all but its last token, which must be computed so that
   logits exist) is offered to it (`reuse_for`); the session's blocks past that prefix are released
   at once. The prefix may end inside a block: that block is kept, and written in place from there,
   only if nothing else holds it and the prefix cache does not promise its content (unhashed);
   otherwise the prefix is cut back to whole blocks.
3. Once admitted (`claim`), the request owns those blocks (taken by reference, then the session lets
   go of its own references: a move, not a share) and holds the session until it finishes: a held
   session is not evictable, and another request with the same id that is admitted meanwhile runs
   without it (prefilling as if it had no session). When both finish, the last one to finish becomes
   the session's content (the conversation continues from its latest turn).

Bounds: at most `max_sessions` sessions (storing one more evicts the least recently used idle
one), idle ones expire after `ttl` seconds, and under memory pressure the scheduler evicts idle
sessions, least recently used first, before it preempts a running request or refuses admission.
Eviction frees the blocks through the normal path (with prefix caching on, their full blocks stay
in the prefix cache) and forgets the session: its next turn prefills from scratch, with the same
output. `close` frees a session at once; a request still running with it then finishes without
storing anything.

Pure Python: never touches device memory. The clock is injectable so tests never sleep.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus


class SessionReuse(NamedTuple):
    block_ids: list[int]  # the session's blocks a request starts with, in order
    num_tokens: int  # computed tokens they hold (may end inside the last block)


@dataclass
class Session:
    session_id: str
    last_used: float  # clock seconds; LRU order and TTL
    # Tokens whose K/V the session's held blocks contain (KVCacheManager.held_table), as Request.key_ids gives
    # them (an image's placeholders by its content). Empty while a request holds the session: that request owns
    # the blocks then.
    token_ids: list[int] = field(default_factory=list)
    holder: Request | None = None  # the admitted request that took the blocks, until it finishes
    cache_salt: int = 0  # Request.cache_salt of the turn that computed them (its LoRA adapter's)


@dataclass(frozen=True)
class SessionStats:
    num_sessions: int
    num_blocks: int  # KV blocks held by idle sessions
    hit_tokens: int  # prompt tokens served from sessions since start (not recomputed)
    num_evicted: int  # sessions evicted (count, TTL or memory) since start; closes not counted


class SessionStore:
    def __init__(self, kv: KVCacheManager, max_sessions: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.max_sessions = max_sessions  # 0 disables sessions: requests with an id free their blocks
        self.ttl = ttl
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.hit_tokens = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def token_ids(self, session_id: str) -> list[int]:
        s = self._sessions.get(session_id)
        return list(s.token_ids) if s is not None else []

    def stats(self) -> SessionStats:
        return SessionStats(len(self._sessions), self.kv.num_held_blocks, self.hit_tokens, self.num_evicted)

    # --- a turn starts -------------------------------------------------------------------

    def reuse_for(self, request: Request) -> SessionReuse | None:
        """The session KV a waiting request can start with; None when there is none (unknown or held
        session, nothing in common). Releases the session's blocks past the common prefix: the new
        turn replaces them either way."""
        s = self._sessions.get(request.session_id or "")
        if s is None or s.holder is not None:
            return None
        table = self.kv.held_table(s.session_id)
        matched = 0
        if s.cache_salt == request.cache_salt:  # KV computed under another adapter is nothing in common
            matched = _common_prefix(s.token_ids, request.key_ids(), limit=request.num_tokens - 1)
        num_full, rest = divmod(matched, self.kv.block_size)
        keep = num_full + (1 if rest and self.kv.writable_in_place(table[num_full]) else 0)
        matched = min(matched, keep * self.kv.block_size)
        self.kv.trim_held(s.session_id, keep)
        del s.token_ids[matched:]
        return SessionReuse(list(table), matched) if matched else None

    def claim(self, request: Request, num_reused_tokens: int) -> None:
        """The request was admitted, having taken `num_reused_tokens` of the session's KV by reference
        (see reuse_for): the session lets go of its references and is held until the request ends."""
        s = self._sessions.get(request.session_id or "")
        if s is None or s.holder not in (None, request):  # unknown, or another request's turn
            return
        self.kv.release_held(s.session_id)
        s.token_ids = []
        s.holder = request
        self._touch(s)
        self.hit_tokens += num_reused_tokens

    # --- a turn ends ---------------------------------------------------------------------

    def keep(self, request: Request) -> bool:
        """A request with a session id finished: keep its computed KV as the session's content. False
        (the caller frees the request) when it was aborted, sessions are off, the session is held by
        another request, or no idle session can make room under max_sessions."""
        sid = request.session_id or ""
        s = self._sessions.get(sid)
        if s is not None and s.holder is request:
            s.holder = None
            if request.status == RequestStatus.FINISHED_ABORTED:
                del self._sessions[sid]  # its blocks went to the request, which is freed: nothing left
        if request.status == RequestStatus.FINISHED_ABORTED or self.max_sessions == 0:
            return False
        s = self._sessions.get(sid)
        if s is not None and s.holder is not None:
            return False
        if s is None:
            if len(self._sessions) >= self.max_sessions and not self._evict_first_idle(sid, need_blocks=False):
                return False
            s = self._sessions[sid] = Session(sid, self.clock())
        self.kv.release_held(sid)  # an earlier turn's content, when this turn ran without claiming it
        self.kv.hold(request, sid)
        s.token_ids = request.key_ids(0, request.num_computed_tokens)
        s.cache_salt = request.cache_salt
        self._touch(s)
        return True

    # --- bounds --------------------------------------------------------------------------

    def close(self, session_id: str) -> bool:
        """End a session now; False if it is unknown (never stored, closed, or evicted). A request
        running with it finishes without storing its KV."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            return False
        if s.holder is not None:
            s.holder.session_id = None
        self.kv.release_held(session_id)
        return True

    def evict_lru(self, keep: str | None = None) -> bool:
        """Memory pressure: evict the least recently used idle session that holds blocks (never
        `keep`, the session of the request being placed). False when there is none."""
        return self._evict_first_idle(keep, need_blocks=True)

    def expire(self) -> None:
        """Evict idle sessions unused for longer than the TTL. Runs every step: the store is in last-used
        order, so the walk stops at the first session still within it."""
        now = self.clock()
        expired = []
        for s in self._sessions.values():
            if now - s.last_used <= self.ttl:
                break
            if s.holder is None:  # a running turn's session does not expire under it
                expired.append(s)
        for s in expired:
            self._evict(s)

    def _evict_first_idle(self, keep: str | None, need_blocks: bool) -> bool:
        """Evict the least recently used idle session other than `keep` (with blocks, if need_blocks)."""
        for s in self._sessions.values():
            if s.holder is None and s.session_id != keep and (not need_blocks or self.kv.held_table(s.session_id)):
                self._evict(s)
                return True
        return False

    def _evict(self, s: Session) -> None:
        del self._sessions[s.session_id]
        self.kv.release_held(s.session_id)
        self.num_evicted += 1

    def _touch(self, s: Session) -> None:
        s.last_used = self.clock()
        self._sessions.move_to_end(s.session_id)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(limit, len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
