"""TierStack: the tiers below one device pool, as the ``LowerTier`` a ``PrefixLifecycle`` declares.

- ``nominates`` then ``extend`` (from ``PrefixLifecycle.match``, after the device match): the lookup continues in the
  host tier, then in the store, each page verified the same way; hits get fresh device pages, their bytes are copied
  up, they join the device index, and the request's state carries a ``PageFetch`` that says when they may be read.
- ``spill`` (from ``PrefixIndex.evict``, the one place a cached page leaves the device): the evicted pages' bytes and
  verifying ids move to the host tier (write-back on eviction).
- ``publish`` (from ``PrefixLifecycle.commit``, after pages are indexed): newly indexed pages are put to the store
  (write-through, so other instances can use a prefix while it is hot here, and while its request still runs).

``spill`` and ``publish`` come under the pool's ``cache_lock``; ``extend`` takes it itself, around everything but the
store read. A tier's failure is a miss: nothing here raises into a request. ``stats()`` is a ``TierStats``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import xxhash

from mmcache.errors import OutOfPages
from mmcache.names import Fingerprint
from mmcache.pool import PagePool, copy_pages
from mmcache.reclaim import make_room
from mmcache.stats import TierStats
from mmcache.tiers.host import HostTier
from mmcache.tiers.lineage import RequestLineage, root_lineage
from mmcache.tiers.page_format import Expected, encode_page, page_key
from mmcache.tiers.store import PUBLISHED, StoreTier

KIND = "kv"  # the kind of entry a TierStack puts in a ``StoreTier`` (``KINDS``)


class PageFetch:
    """Pages of one request copied up from lower tiers (M*'s ``read_in_progress``): the request is not scheduled
    before ``ready``. A copy on the CPU is synchronous, so the fetch is ready when the state is returned; a copy
    from pinned host memory to CUDA is asynchronous and ``ready`` polls its event."""

    def __init__(self, host_pages: int, store_pages: int, event=None, on_done=None):
        self.host_pages, self.store_pages = host_pages, store_pages
        self._event, self._on_done = event, on_done
        if event is None:
            self._done()

    @property
    def ready(self) -> bool:
        if self._event is not None and self._event.query():
            self._done()
        return self._event is None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._done()

    def _done(self) -> None:
        self._event = None
        if self._on_done is not None:
            self._on_done, on_done = None, self._on_done
            on_done()

    def __repr__(self) -> str:
        return f"PageFetch(host={self.host_pages}, store={self.store_pages}, ready={self.ready})"


@dataclasses.dataclass
class TierStack:
    """The host tier and/or the shared store under one device pool (either may be None)."""

    fingerprint: Fingerprint
    host: HostTier | None = None
    store: StoreTier | None = None
    adopted: dict = dataclasses.field(init=False, repr=False,  # pages of each tier's hits given to requests
                                      default_factory=lambda: {"host": 0, "store": 0})

    # ----------------------------------------------------------------- device -> host (write-back on eviction)
    def spill(self, index, pages: np.ndarray) -> None:
        """``index`` is evicting ``pages`` (their bytes and ids are still intact): copy them into the host tier."""
        if self.host is None or not len(pages):
            return
        v = index.tier_view()
        memo: dict[int, bytes] = {}

        def lineage(page: int) -> bytes:  # of pages 0..page, walking up to the first known ancestor
            up = []
            while page >= 0 and page not in memo:
                up.append(page)
                page = int(v.parent[page])
            acc = memo[page] if page >= 0 else root_lineage(self.fingerprint, v.salt_bytes(int(v.salt[up[-1]])))
            for q in reversed(up):
                acc = memo[q] = xxhash.xxh3_128_digest(acc + v.tokens[q].tobytes() + v.media_lo[q].tobytes()
                                                       + v.media_hi[q].tobytes())  # == link(), inlined
            return acc

        plins = [lineage(int(v.parent[p])) if v.parent[p] >= 0
                 else root_lineage(self.fingerprint, v.salt_bytes(int(v.salt[p]))) for p in pages.tolist()]
        self.host.put(index.pool, pages.tolist(), v.name[pages].tolist(), v.tokens[pages], v.media(pages), plins,
                      v.depth[pages])

    # ----------------------------------------------------------------- lookup continues below the device
    def nominates(self, name) -> bool:
        """Whether the lookup may continue below the device at the page named ``name`` (the all-miss fast path:
        one dict probe when there is no store; with a store, every device miss asks it)."""
        return self.store is not None or (self.host is not None and name in self.host)

    def extend(self, index, idx: np.ndarray, names, tokens: np.ndarray, mids: np.ndarray, salt: bytes,
               salt_id: int, media: dict[int, bytes] | None = None) -> tuple[list[int], PageFetch | None]:
        """Continue a device match ``idx`` (pages the request already holds) through the tiers (the caller asked
        ``nominates`` first). Returns the request's pages (``idx`` then fresh pages holding tier hits, each with the
        request's owner; the index adopts them too) and a ``PageFetch`` (None when no tier hit).

        Called without the pool's ``cache_lock``: the host tier is read under it, the store outside it (a batched
        read within the store's deadline, verified), and the hits are adopted under it again, only if the device
        chain they continue is still the one matched (its last page's serial is unchanged)."""
        pool: PagePool = index.pool
        k = int(idx.size)
        lineage = RequestLineage(root_lineage(self.fingerprint, salt), tokens, mids, index.page_size)
        with pool.cache_lock:
            serial = index.serial(int(idx[-1])) if k else 0
            host = self.host.match(names, k, tokens, mids, lineage) if self.host is not None else []
        store = []
        if self.store is not None:
            want = Expected(self.fingerprint, salt, pool.page_shape, pool.dtype, pool.page_bytes)
            store = self.store.match(names, k + len(host), tokens, mids, lineage, want)
        if not host and not store:
            return idx.tolist(), None
        with pool.cache_lock:
            if k and index.serial(int(idx[-1])) != serial:  # the chain left the index meanwhile: nothing hangs on it
                if host:
                    self.host.pool.release(host)
                return idx.tolist(), None
            return self._adopt(index, idx, names, tokens, mids, salt_id, media, host, store)

    def _adopt(self, index, idx, names, tokens, mids, salt_id, media, host: list[int], store: list) -> tuple:
        """Fresh device pages for the verified hits (``host`` pages, then ``store`` bytes), copied up and indexed;
        under the lock."""
        pool: PagePool = index.pool
        h = len(host) + len(store)
        try:
            make_room(pool, h, index.evict_batch_pages, index.counters)
        except OutOfPages as e:  # live requests fill the device: keep the part of the hit that fits, if any
            h -= e.shortfall
            if h > 0:
                make_room(pool, h, index.evict_batch_pages, index.counters)
            if len(host) > max(h, 0):
                self.host.pool.release(host[max(h, 0):])
            host, store = host[:max(h, 0)], store[:max(h - len(host), 0)]
            if h <= 0:
                return idx.tolist(), None
        fresh = pool.alloc(h)
        event = None
        if host:
            event = copy_up(self.host.pool, host, pool, fresh[:len(host)])
        if store and pool.data is not None:
            rows = torch.stack([torch.frombuffer(bytearray(b), dtype=pool.dtype).view(pool.page_shape) for b in store])
            pool.data[fresh[len(host):]] = rows.to(pool.device)
        pages = idx.tolist() + fresh
        m = len(pages)
        P = index.page_size
        _, walked, _ = index.insert(pages, list(names[:m]), tokens[:m * P].reshape(m, P), mids[:m], salt_id,
                                    media=media)  # index's own owners
        dropped: list[int] = []
        if walked != pages:  # another request indexed equal pages while the store was read (or a name collided):
            swap = [q for q in range(len(walked)) if walked[q] != pages[q]]  # hold the indexed pages instead, so
            pool.retain([walked[q] for q in swap], distinct=True)            # the claim's chain is what is indexed
            dropped = [pages[q] for q in swap] + pages[len(walked):]
            pages = walked
        served = len(pages) - len(idx)  # host hits first, then the store's
        self.adopted["host"] += min(len(host), served)
        self.adopted["store"] += served - min(len(host), served)

        def release() -> None:
            """Once the copy-up has landed: the host pages read, and the fresh pages the hit did not keep (freed
            before, a page could be handed to another request while an asynchronous copy still wrote into it)."""
            if host:
                self.host.pool.release(host)
            if dropped:
                pool.release(dropped)

        return pages, PageFetch(len(host), len(store), event, release)

    # ----------------------------------------------------------------- device -> store (write-through on index)
    def publish(self, pool: PagePool, pages: list[int], positions: list[int], names, seq: np.ndarray,
                  mids: np.ndarray, salt: bytes) -> None:
        """Put the newly indexed pages ``pages[j]`` (chain position ``j`` for j in ``positions``) to the store. The
        bytes are read now, under the caller's lock; the puts run on the store's publisher thread."""
        if self.store is None or not positions or not self.store.publishing(len(positions), KIND):
            return
        P = self.fingerprint.page_size
        lineage = RequestLineage(root_lineage(self.fingerprint, salt), seq, mids, P)
        want = Expected(self.fingerprint, salt, pool.page_shape, pool.dtype, pool.page_bytes)
        rows = None
        if pool.data is not None:
            sel = torch.as_tensor([pages[j] for j in positions], device=pool.data.device)
            rows = pool.data.index_select(0, sel).cpu().contiguous()
        items = []
        for i, j in enumerate(positions):
            data = rows[i].view(torch.uint8).numpy().tobytes() if rows is not None else b""
            items.append((page_key(names[j]), encode_page(want.fp_bytes, want.salt, want.layout, names[j], j,
                                                          seq[j * P:(j + 1) * P], mids[j], lineage.before(j), data,
                                                          self.store.key)))
        self.store.publish(items, KIND)

    def stats(self) -> TierStats:
        """The tiers' counters and state now. Read without a lock: each counter is exact, the set may come from
        instants a lookup apart (the store's threads count outside every lock)."""
        out = {"page_size": self.fingerprint.page_size, "host": self.host is not None, "store": self.store is not None}
        if self.host is not None:
            out.update(_prefixed("host_", self.host.counters), host_adopted_pages=self.adopted["host"],
                       host_pages_held=len(self.host))
        if self.store is not None:  # the store's reads and health, then its puts and removals of KV pages alone
            out.update(_prefixed("store_", self.store.counters), store_adopted_pages=self.adopted["store"],
                       store_up=self.store.up, store_wait=self.store.wait.snapshot())
            out.update(_prefixed("store_", {PUBLISHED[KIND] if k == "published" else k: v
                                            for k, v in self.store.kinds[KIND].items()}))
        return TierStats(**out)


_FIELDS = frozenset(f.name for f in dataclasses.fields(TierStats))


def _prefixed(prefix: str, counters: dict) -> dict:
    """The ``TierStats`` fields named ``prefix`` + a key of ``counters`` (a counter no field declares is left out)."""
    return {f"{prefix}{k}": v for k, v in counters.items() if f"{prefix}{k}" in _FIELDS}


def copy_up(src: PagePool, src_pages: list[int], dst: PagePool, dst_pages: list[int]):
    """Copy host pages to device pages. From pinned memory to CUDA the copy is asynchronous and the returned CUDA
    event marks its end; otherwise it is synchronous and None is returned."""
    if dst.data is None:
        return None
    if not (dst.data.is_cuda and getattr(src, "pinned", False)):
        copy_pages(src, src_pages, dst, dst_pages)
        return None
    rows = src.data.index_select(0, torch.as_tensor(src_pages)).pin_memory()
    dst.data.index_copy_(0, torch.as_tensor(dst_pages, device=dst.data.device), rows.to(dst.data.device,
                                                                                         non_blocking=True))
    event = torch.cuda.Event()
    event.record()
    return event
