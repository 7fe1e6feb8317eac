"""PagedAllocator: the per-request, per-label page allocator an engine calls, on top of one PrefixCache per label.

It offers what an engine's paged allocation manager offers (add a request with its labels, grow a label to a
sequence length, read its pages, tear it down, offload it to host memory and back, slide a window) so an engine can
swap its allocator for this one and get prefix reuse. A label is one KV cache of the model (e.g. "text" and "audio",
or a thinker and a talker); labels never share pages, and each label's pool may have its own page shape and size.

A label of a request is admitted into its PrefixCache in one of two ways:
- with a prompt (``add_request(token_ids=...)`` or ``set_prompt``): its verified prefix is reused, and at teardown its
  full written pages (prompt and output) are indexed for later requests;
- without one, on its first ``alloc``: pages are allocated from position 0 and nothing is matched or ever indexed,
  because KV that token ids do not describe cannot be named.

Deferred teardown: ``remove_request``/``abort_request`` on a request that a batch in flight uses (``begin_batch``
... ``complete_batch``, or ``with allocator.batch(rids)``) is queued and applied when the last such batch completes,
never earlier, so no page a running batch reads is released under it. ``offload_request`` and ``reset_label`` are
refused while a batch uses the request; ``release_oldest`` applies at once (see its docstring).

Every public method holds ``self._lock`` (re-entrant) around this object's tables; each PrefixCache takes its own lock
inside, always after this one. Errors are raised before anything changes. The caches belong to the allocator: use
them directly only for index-level operations (``clear``, ``stats``), never for its requests.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Hashable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from mmcache.checks import as_int
from mmcache.errors import AllocationFailed, DuplicateRequest, InvalidRequest, OutOfPages, UnknownRequest
from mmcache.names import as_tokens
from mmcache.pool import PagePool, can_hold, copy_pages
from mmcache.prefix_cache import PrefixCache, RequestState
from mmcache.stats import AllocatorStats

_ENDED_MEMORY = 65536  # removed ids remembered only to say "already removed" rather than "never added"


@dataclasses.dataclass(frozen=True, slots=True)
class Reloaded:
    """One label brought back by ``reload_request``. ``restored_pages`` offloaded pages got their data back;
    ``discarded_pages`` did not, because they lie past ``state.computed_tokens``: part of the shared prefix before
    them was evicted while the request was offloaded, so the engine recomputes from ``state.computed_tokens``."""

    state: RequestState
    restored_pages: int
    discarded_pages: int


@dataclasses.dataclass(slots=True, eq=False)
class _Offloaded:
    host: PagePool
    first_page: int         # position of the first offloaded page (the shared pages before it stayed resident)
    pages: int              # offloaded positions: the cache gives this many fresh pages back at resume
    host_pages: list[int]   # data of positions first_page.. (may be shorter than ``pages``: the rest is recomputed)


@dataclasses.dataclass(slots=True, eq=False)
class _Removal:
    abort: bool
    outputs: dict[str, np.ndarray]


@dataclasses.dataclass(slots=True, eq=False)
class _Entry:
    labels: dict[str, bool | None]          # None: not admitted yet; True: admitted with a prompt; False: without
    batches: int = 0                        # batches in flight that use the request
    removal: _Removal | None = None         # teardown queued until ``batches`` drops to 0
    offloaded: dict[str, _Offloaded] | None = None


class PagedAllocator:
    """Requests with one PrefixCache request per label; see the module docstring for the contract."""

    def __init__(self, caches: Mapping[str, PrefixCache]):
        if not caches:
            raise InvalidRequest("a PagedAllocator needs at least one label")
        pools = [id(c.pool) for c in caches.values()]
        if len(set(pools)) != len(pools):
            raise InvalidRequest("labels never share pages: give every label its own pool")
        self._caches = dict(caches)
        self._lock = threading.RLock()
        self._requests: dict[Hashable, _Entry] = {}
        self._ended: OrderedDict[Hashable, None] = OrderedDict()
        self._batches: dict[int, tuple] = {}
        self._batch_ids = itertools.count()

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self._caches)

    def cache(self, label: str) -> PrefixCache:
        return self._caches[self._label(label)]

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    # ----------------------------------------------------------------- requests
    def add_request(self, rid: Hashable, labels: Iterable[str], token_ids=None, media=(),
                    salt: bytes = b"") -> dict[str, RequestState]:
        """Register ``rid`` with ``labels``; admit each label that has a prompt, reusing its cached prefix.

        ``token_ids``: None, a mapping label -> prompt, or one prompt for every label. ``media`` (``(offset,
        digest)`` marks) is likewise a mapping or one list for every prompted label. Returns every label's state;
        a label without a prompt has an empty one until ``set_prompt`` or its first ``alloc``.
        """
        labels = list(labels)
        for label in labels:
            self._label(label)
        if len(set(labels)) != len(labels):
            raise InvalidRequest(f"request {rid!r}: labels repeat in {labels!r}")
        prompts = self._per_label(rid, token_ids, labels, "token_ids")
        if not prompts and len(media):
            raise InvalidRequest(f"request {rid!r}: media marks without a prompt")
        marks = self._per_label(rid, media, list(prompts), "media")
        with self._lock:
            if rid in self._requests:
                raise DuplicateRequest(f"request {rid!r} is already added")
            for label, tokens in prompts.items():  # validate every prompt before admitting any
                prompts[label] = as_tokens(tokens, self._caches[label].vocab_size)
            entry = _Entry(dict.fromkeys(labels))
            admitted = []
            try:
                for label, tokens in prompts.items():
                    self._caches[label].admit(rid, tokens, media=marks.get(label, ()), salt=salt)
                    admitted.append(label)
                    entry.labels[label] = True
            except BaseException:
                for label in admitted:
                    self._caches[label].abort(rid)
                raise
            self._requests[rid] = entry
            self._ended.pop(rid, None)
            return {label: self._state(rid, entry, label) for label in labels}

    def set_prompt(self, rid: Hashable, label: str, token_ids, media=(), salt: bytes = b"") -> RequestState:
        """Admit a label registered without a prompt, with prefix reuse (before its first ``alloc``)."""
        with self._lock:
            entry = self._entry(rid)
            self._not_admitted(rid, entry, label)
            state = self._caches[label].admit(rid, token_ids, media=media, salt=salt)
            entry.labels[label] = True
            return state

    def alloc(self, rid: Hashable, label: str, seq_len: int) -> RequestState:
        """Hold pages for ``seq_len`` tokens of ``label`` (never shrinks: a smaller ``seq_len`` changes nothing).

        Cold cached pages are evicted first; ``AllocationFailed`` (with ``pages_short``, ``request_id``, ``label``)
        is raised only when live requests alone need more than the label's pool, and then nothing changes.
        """
        seq_len = as_int(seq_len, "seq_len")
        if seq_len < 0:
            raise InvalidRequest(f"request {rid!r}: seq_len must be >= 0, got {seq_len}")
        with self._lock:
            entry = self._entry(rid)
            cache = self._caches[self._label(label, rid, entry)]
            if entry.offloaded is not None:
                raise InvalidRequest(f"request {rid!r} is offloaded; reload it first")
            fresh = entry.labels[label] is None
            if fresh:  # first alloc of a label without a prompt
                cache.admit_unnamed(rid)
                entry.labels[label] = False
            try:
                state = cache.state(rid)
                return state if seq_len <= state.seq_len else cache.grow(rid, seq_len)
            except OutOfPages as err:
                if fresh:
                    cache.abort(rid)
                    entry.labels[label] = None
                raise AllocationFailed(err.shortfall, rid, label, err.requested) from None

    def get_state(self, rid: Hashable, label: str) -> RequestState:
        """``label``'s pages in position order, ``seq_len``, ``position_id_start``, ``matched_tokens``,
        ``computed_tokens`` (and the window fields); empty for a label not admitted yet."""
        with self._lock:
            entry = self._entry(rid)
            return self._state(rid, entry, self._label(label, rid, entry))

    def get_labels(self, rid: Hashable) -> list[str]:
        with self._lock:
            return list(self._entry(rid).labels)

    def mark_computed(self, rid: Hashable, label: str, tokens: int) -> RequestState:
        """The KV of ``label``'s first ``tokens`` tokens is written (only written pages are ever indexed)."""
        with self._lock:
            return self._admitted_cache(rid, label).mark_computed(rid, tokens)

    def protect_prefix(self, rid: Hashable, label: str, tokens: int) -> RequestState:
        """Make ``label`` windowed: its first ``tokens`` are kept, and only their full pages are indexed at teardown."""
        with self._lock:
            return self._admitted_cache(rid, label).protect_prefix(rid, tokens)

    def release_oldest(self, rid: Hashable, label: str, pages: int) -> RequestState:
        """Release the ``pages`` oldest pages after the protected run, through the counted release (a page the index
        or another request holds is decremented, never freed). Applies at once, also while a batch uses the request:
        release only pages that no batch in flight reads."""
        with self._lock:
            return self._admitted_cache(rid, label).release_oldest(rid, pages)

    def reset_label(self, rid: Hashable, label: str, output_ids=()) -> int:
        """Tear one label down (indexing its written pages if it had a prompt) and leave it not admitted, so a later
        ``set_prompt`` or ``alloc`` starts it afresh. Refused while a batch uses the request or it is offloaded.
        Returns the pages newly indexed."""
        with self._lock:
            entry = self._entry(rid)
            self._admitted_cache(rid, label)
            self._idle(rid, entry, "reset a label of")
            has_outputs = output_ids is not None and len(output_ids)
            outputs = self._outputs(rid, entry, {label: output_ids} if has_outputs else None)
            added = self._teardown_label(rid, entry, label, outputs.get(label), abort=False)
            entry.labels[label] = None
            return added

    def remove_request(self, rid: Hashable, output_ids=None) -> bool:
        """Tear the request down: each label with a prompt indexes its full written pages (prompt + ``output_ids``,
        a mapping label -> ids or one list for every such label), every other page is released. Queued while a
        batch uses the request; returns True if applied now, False if queued. An offloaded request is aborted."""
        with self._lock:
            entry = self._entry(rid)
            return self._remove(rid, entry, _Removal(False, self._outputs(rid, entry, output_ids)))

    def abort_request(self, rid: Hashable) -> bool:
        """Like ``remove_request`` but indexes nothing (the request's KV may be unusable)."""
        with self._lock:
            return self._remove(rid, self._entry(rid), _Removal(True, {}))

    # ----------------------------------------------------------------- batches
    def begin_batch(self, rids: Iterable[Hashable]) -> int:
        """Mark ``rids`` as used by a batch in flight; their teardown waits for ``complete_batch(batch_id)``."""
        rids = tuple(rids)
        with self._lock:
            if len(set(rids)) != len(rids):
                raise InvalidRequest("a request appears twice in one batch")
            for rid in rids:
                entry = self._entry(rid)
                if entry.removal is not None:
                    raise InvalidRequest(f"request {rid!r} is being removed; it cannot join a batch")
                if entry.offloaded is not None:
                    raise InvalidRequest(f"request {rid!r} is offloaded; reload it first")
            for rid in rids:
                self._requests[rid].batches += 1
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = rids
            return batch_id

    def complete_batch(self, batch_id: int) -> list[Hashable]:
        """The batch is done: apply the teardowns queued for its requests (those in no other batch in flight).
        Returns the request ids torn down now."""
        with self._lock:
            rids = self._batches.pop(batch_id, None)
            if rids is None:
                raise InvalidRequest(f"batch {batch_id!r} is not in flight")
            done = []
            for rid in rids:
                entry = self._requests[rid]
                entry.batches -= 1
                if not entry.batches and entry.removal is not None:
                    self._teardown(rid, entry, entry.removal)
                    done.append(rid)
            return done

    @contextmanager
    def batch(self, rids: Iterable[Hashable]) -> Iterator[int]:
        """``with allocator.batch(rids) as batch_id:`` run a step; the batch completes on exit, even on error."""
        batch_id = self.begin_batch(rids)
        try:
            yield batch_id
        finally:
            self.complete_batch(batch_id)

    # ----------------------------------------------------------------- offload
    def offload_request(self, rid: Hashable, host_pool: PagePool | Mapping[str, PagePool]) -> int:
        """Move the request out of device memory; returns the device pages freed.

        Per admitted label: shared pages are released (decremented; they stay resident for their other owners), the
        exclusively owned pages are copied into host pages of ``host_pool`` (one pool, or a mapping label -> pool,
        each with the label pool's page shape and dtype) and released. The request stays registered, not torn down.
        """
        with self._lock:
            entry = self._entry(rid)
            self._idle(rid, entry, "offload")
            labels = [label for label, admitted in entry.labels.items() if admitted is not None]
            hosts = {label: self._host(host_pool, label) for label in labels}
            states = {label: self._caches[label].state(rid) for label in labels}
            for label, state in states.items():
                if state.protected_tokens is not None or state.released_tokens:
                    raise InvalidRequest(f"request {rid!r}: label {label!r} is windowed; windowed requests are not "
                                         f"offloaded")
            # Host pages first, so that a full host pool refuses before anything moves.
            reserved: dict[str, list[int]] = {}
            own: dict[str, list[int]] = {}
            try:
                for label, state in states.items():
                    counts = self._caches[label].pool.counts[list(state.page_indices)]
                    reserved[label] = self._host_alloc(rid, label, hosts[label], int((counts == 1).sum()))
                for label in labels:
                    own[label] = self._caches[label].suspend(rid)
                    # Only a concurrent cache.clear() (which unshares pages) makes these differ.
                    extra = len(own[label]) - len(reserved[label])
                    if extra > 0:
                        reserved[label] += self._host_alloc(rid, label, hosts[label], extra)
                    elif extra < 0:
                        hosts[label].release(reserved[label][extra:])
                        del reserved[label][extra:]
            except BaseException:
                for label in own:
                    self._caches[label].resume(rid)
                for label, pages in reserved.items():
                    hosts[label].release(pages)
                raise
            freed, entry.offloaded = 0, {}
            for label in labels:
                cache = self._caches[label]
                copy_pages(cache.pool, own[label], hosts[label], reserved[label])
                first_page = cache.state(rid).position_id_start // cache.page_size
                freed += cache.release_suspended(rid)
                entry.offloaded[label] = _Offloaded(hosts[label], first_page, len(own[label]), reserved[label])
            return freed

    def reload_request(self, rid: Hashable, host_pool: PagePool | Mapping[str, PagePool]) -> dict[str, Reloaded]:
        """Bring an offloaded request back: each label's released prefix is looked up again through the index,
        fresh pages take the offloaded positions and get the host data back, and the host pages are freed.

        If part of a label's shared prefix was evicted meanwhile, ``computed_tokens`` drops to what is held
        contiguously and the offloaded data past it is discarded (see ``Reloaded``). ``AllocationFailed`` if a
        label's pool cannot hold the request: the request then stays offloaded as it was, except that a label whose
        prefix was evicted keeps its lowered ``computed_tokens`` (its offloaded data lay past it and is dropped).
        """
        with self._lock:
            entry = self._entry(rid)
            if entry.offloaded is None:
                raise InvalidRequest(f"request {rid!r} is not offloaded")
            for label, off in entry.offloaded.items():
                if self._host(host_pool, label) is not off.host:
                    raise InvalidRequest(f"request {rid!r}: label {label!r} was offloaded into another host pool")
            resumed = []
            try:
                for label in entry.offloaded:
                    try:
                        self._caches[label].resume(rid)
                    except OutOfPages as err:
                        raise AllocationFailed(err.shortfall, rid, label, err.requested) from None
                    resumed.append(label)
            except BaseException:
                for label in resumed:
                    self._offload_again(rid, entry, label)
                raise
            out = {}
            for label, off in entry.offloaded.items():
                cache = self._caches[label]
                state = cache.state(rid)
                keep = [j for j in range(len(off.host_pages))
                        if (off.first_page + j) * cache.page_size < state.computed_tokens]
                copy_pages(off.host, [off.host_pages[j] for j in keep],
                           cache.pool, [state.page_indices[off.first_page + j] for j in keep])
                off.host.release(off.host_pages)
                out[label] = Reloaded(state, len(keep), off.pages - len(keep))
            entry.offloaded = None
            return out

    def is_offloaded(self, rid: Hashable) -> bool:
        with self._lock:
            return self._entry(rid).offloaded is not None

    def stats(self) -> AllocatorStats:
        """The allocator's own counts; each label's cache has its own ``stats()`` (pages, hits, evictions)."""
        with self._lock:
            entries = self._requests.values()
            return AllocatorStats(len(self._requests), len(self._batches), sum(e.removal is not None for e in entries),
                                  sum(e.offloaded is not None for e in entries))

    # ----------------------------------------------------------------- internals (callers hold the lock)
    def _label(self, label: str, rid: Hashable = None, entry: _Entry | None = None) -> str:
        if label not in self._caches:
            raise InvalidRequest(f"unknown label {label!r}; labels are {list(self._caches)}")
        if entry is not None and label not in entry.labels:
            raise InvalidRequest(f"request {rid!r} has no label {label!r}; it has {list(entry.labels)}")
        return label

    def _entry(self, rid: Hashable) -> _Entry:
        entry = self._requests.get(rid)
        if entry is None:
            why = "has already been removed" if rid in self._ended else "was never added"
            raise UnknownRequest(f"request {rid!r} {why}")
        return entry

    def _state(self, rid: Hashable, entry: _Entry, label: str) -> RequestState:
        if entry.labels[label] is None:
            return RequestState(rid, (), 0, 0, 0, 0)
        return self._caches[label].state(rid)

    def _admitted_cache(self, rid: Hashable, label: str) -> PrefixCache:
        entry = self._entry(rid)
        if entry.labels.get(self._label(label, rid, entry)) is None:
            raise InvalidRequest(f"request {rid!r}: label {label!r} is not admitted yet (alloc or set_prompt first)")
        return self._caches[label]

    def _not_admitted(self, rid: Hashable, entry: _Entry, label: str) -> None:
        if entry.labels.get(self._label(label, rid, entry), True) is not None:
            raise InvalidRequest(f"request {rid!r}: label {label!r} is already admitted")
        if entry.offloaded is not None:
            raise InvalidRequest(f"request {rid!r} is offloaded; reload it first")

    def _idle(self, rid: Hashable, entry: _Entry, what: str) -> None:
        if entry.batches:
            raise InvalidRequest(f"cannot {what} request {rid!r}: a batch in flight uses it")
        if entry.offloaded is not None:
            raise InvalidRequest(f"cannot {what} request {rid!r}: it is offloaded")

    @staticmethod
    def _per_label(rid: Hashable, value, labels: Sequence[str], what: str) -> dict:
        """A mapping label -> value (checked against ``labels``), or ``value`` for every label."""
        if value is None:
            return {}
        if isinstance(value, Mapping):
            stray = [label for label in value if label not in labels]
            if stray:
                raise InvalidRequest(f"request {rid!r}: {what} for label(s) {stray!r} not among {list(labels)!r}")
            return dict(value)
        return dict.fromkeys(labels, value)

    def _outputs(self, rid: Hashable, entry: _Entry, output_ids) -> dict[str, np.ndarray]:
        """Output ids per prompted label, validated now so that a queued teardown cannot fail later."""
        if entry.removal is not None:
            raise InvalidRequest(f"request {rid!r}: its removal is already queued behind a batch in flight")
        prompted = [label for label, admitted in entry.labels.items() if admitted]
        if isinstance(output_ids, Mapping) and any(entry.labels.get(label) is False for label in output_ids):
            raise InvalidRequest(f"request {rid!r}: output ids for a label without a prompt (never indexed)")
        return {label: as_tokens(ids, self._caches[label].vocab_size)
                for label, ids in self._per_label(rid, output_ids, prompted, "output_ids").items()}

    def _remove(self, rid: Hashable, entry: _Entry, removal: _Removal) -> bool:
        if entry.removal is not None:
            raise InvalidRequest(f"request {rid!r}: its removal is already queued behind a batch in flight")
        if entry.batches:
            entry.removal = removal
            return False
        self._teardown(rid, entry, removal)
        return True

    def _teardown(self, rid: Hashable, entry: _Entry, removal: _Removal) -> None:
        for label in entry.labels:
            self._teardown_label(rid, entry, label, removal.outputs.get(label), removal.abort)
        del self._requests[rid]
        self._ended[rid] = None
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _teardown_label(self, rid: Hashable, entry: _Entry, label: str, outputs, abort: bool) -> int:
        admitted, cache = entry.labels[label], self._caches[label]
        off = entry.offloaded.get(label) if entry.offloaded else None
        if admitted is None:
            return 0
        if off is not None:  # its KV is on the host, not in pages: nothing to index
            off.host.release(off.host_pages)
            off.host_pages = []
        if admitted and not abort and off is None:
            return cache.finish(rid, () if outputs is None else outputs)
        cache.abort(rid)
        return 0

    def _host(self, host_pool, label: str) -> PagePool:
        host = host_pool.get(label) if isinstance(host_pool, Mapping) else host_pool
        pool = self._caches[label].pool
        if not isinstance(host, PagePool) or host is pool or not can_hold(host, pool):
            raise InvalidRequest(f"label {label!r} needs a host PagePool of page shape {pool.page_shape} and "
                                 f"{pool.dtype}, other than its own pool; got {host!r}")
        return host

    @staticmethod
    def _host_alloc(rid: Hashable, label: str, host: PagePool, n: int) -> list[int]:
        try:
            return host.alloc(n)
        except OutOfPages as err:
            raise AllocationFailed(err.shortfall, rid, label, err.requested) from None

    def _offload_again(self, rid: Hashable, entry: _Entry, label: str) -> None:
        """Undo a ``resume`` of this call. If the prefix came back whole, the pages go back exactly as they were
        offloaded; if part of it was evicted, ``computed_tokens`` has dropped below every offloaded page, so their
        host data is dropped and the pages past the surviving prefix are offloaded as data-less."""
        cache, off = self._caches[label], entry.offloaded[label]
        own = cache.suspend(rid)
        first_page = cache.state(rid).position_id_start // cache.page_size
        cache.release_suspended(rid)
        if first_page != off.first_page or len(own) != off.pages:
            off.host.release(off.host_pages)
            off.first_page, off.pages, off.host_pages = first_page, len(own), []
