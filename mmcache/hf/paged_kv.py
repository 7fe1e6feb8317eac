"""Pool-backed KV for transformers decoder models: a ``transformers.Cache`` whose K/V live in ``PagePool`` pages that a
``PrefixCache`` names, shares across requests and evicts.

Page layout: ``pool.data`` is ``[num_pages, layers, 2, page_size, kv_heads, head_dim]``. One page id names the K and
V of every layer for ``page_size`` positions, so the prefix index, eviction and offload deal in whole pages and never
in per-layer pieces. Inside a layer's K (or V) the page is token-major ``[page_size, kv_heads, head_dim]`` (the
"NHD" block of vLLM and FlashInfer): a paged-attention kernel that takes a page stride reads it in place, and the
write of one decode step is one contiguous ``[layers, 2, kv_heads, head_dim]`` slab per page slot.

Attention in transformers wants ``[batch, kv_heads, seq, head_dim]`` tensors, not a page table. Rather than gather
the whole context from its pages at every step, the cache keeps a per-request staging buffer
``[layers, 2, kv_heads, capacity, head_dim]``: the matched pages are gathered into it once at admission, each forward
appends its K/V to it, and the last layer of each forward writes the new positions through to the pages. Attention
reads ``staging[l, 0, :, :seq]`` views (no copy). The price is one extra copy of the live context in memory; a
paged-attention kernel would read the pages directly and drop the staging buffer.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from mmcache.errors import InvalidRequest
from mmcache.eviction import DEFAULT_POLICY
from mmcache.lifecycle import LowerTier
from mmcache.names import Fingerprint, as_tokens
from mmcache.pool import PagePool, same_device
from mmcache.prefix_cache import PrefixCache, RequestState
from mmcache.weights_fingerprint import weights_fingerprint

_MIN_CAPACITY = 256  # staging positions allocated at least, so short chats never regrow it


def kv_page_shape(config: PreTrainedConfig, page_size: int) -> tuple[int, ...]:
    """The page shape ``(layers, 2, page_size, kv_heads, head_dim)`` of ``config``'s decoder (a VLM's text model).

    Only decoders whose every layer is full attention qualify: a sliding-window, chunked or linear-attention layer
    keeps other state than one K/V row per position, which pages of prefix K/V cannot stand for."""
    text = config.get_text_config(decoder=True)
    kinds = set(get_layer_types_and_kwargs(text)[0])
    if kinds != {"full_attention"}:
        raise ValueError(f"PagedKVCache needs full-attention layers only, got {sorted(kinds)}")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, 2, int(page_size), text.num_key_value_heads, head_dim


class PagedKVLayer(CacheLayerMixin):
    """One decoder layer's view of a ``PagedKVCache``: ``update`` appends to the request's staging buffer and returns
    the layer's whole context; the cache owns the pages and the sequence length."""

    is_sliding = False

    def __init__(self, cache: PagedKVCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check, once, that the model's K/V fit the pool: same dtype and device, same heads and head size."""
        pool = self.cache.pool
        _, _, _, heads, head_dim = pool.page_shape
        for t in (key_states, value_states):
            fits = (t.dtype, t.shape[1], t.shape[-1]) == (pool.dtype, heads, head_dim)
            if not (fits and same_device(t.device, pool.device)):
                raise InvalidRequest(f"layer {self.layer_idx}: K/V of {t.dtype} on {t.device} with {t.shape[1]} "
                                     f"heads of {t.shape[-1]} do not fit the pool ({pool!r})")
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.cache._append(self.layer_idx, key_states, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seq_len

    def get_max_length(self) -> int:
        return -1


class PagedKVCache(Cache):
    """A ``transformers.Cache`` for one request at a time (batch size 1) whose K/V live in ``prefix.pool``.

    Lifecycle: ``admit`` (the matched prefix becomes the request's first pages and ``get_seq_length()`` reports it, so
    the model is fed only the rest; ``generate()`` trims it by itself), any number of forward calls or one
    ``generate()``, then ``finish`` (full written pages go to the index) or ``abort``. An engine serving several
    requests at once gives each its own ``PagedKVCache`` over one shared ``PrefixCache``. Run the model under
    ``torch.inference_mode()`` or ``torch.no_grad()``.

    Invariants:
    - ``seq_len`` equals the request's ``computed_tokens`` in the ``PrefixCache``, and positions ``[0, seq_len)`` of
      the staging buffer equal, bit for bit, the K/V held by the request's pages at those positions;
    - every layer of one forward writes positions ``[seq_len, seq_len + q)``; the last layer writes them through to
      the pages and marks them computed, so a page is indexed only with K/V every layer has written;
    - pages are grown before anything is written: an ``OutOfPages`` from ``PrefixCache.grow`` (raised only when live
      requests alone fill the pool) leaves the cache and the pages as they were;
    - matched pages are only read: the request writes from ``matched_tokens``, a page boundary, into its own pages.
    """

    def __init__(self, prefix: PrefixCache, config: PreTrainedConfig):
        pool = prefix.pool
        want = kv_page_shape(config, prefix.page_size)
        if pool.data is None or pool.page_shape != want:
            raise ValueError(f"the pool's pages must be {want} for this model, got {pool!r}")
        super().__init__(layers=[PagedKVLayer(self, i) for i in range(want[0])])
        self.prefix, self.pool = prefix, pool
        self.page_size = prefix.page_size
        self.rid: Hashable | None = None
        self.seq_len = 0            # tokens whose K/V every layer has written (== computed_tokens)
        self._held = 0              # tokens the request's pages can hold (whole pages)
        self._pages: tuple[int, ...] = ()
        self._kv: torch.Tensor | None = None  # staging [layers, 2, kv_heads, capacity, head_dim]
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: K and V of the staging buffer

    @staticmethod
    def fingerprint_for(model, page_size: int = 16, fingerprint: str | None = None) -> Fingerprint:
        """The fingerprint ``for_model`` names pages under: the weights (``weights_fingerprint``, or ``fingerprint``
        if given), KV dtype, attention backend and page size (a ``TierStack`` under the cache is built with it)."""
        p = next(model.parameters())
        text = model.config.get_text_config(decoder=True)
        return Fingerprint(model=fingerprint or weights_fingerprint(model), kv_dtype=str(p.dtype),
                           attention_backend=str(text._attn_implementation), page_size=page_size)

    @classmethod
    def for_model(cls, model, num_pages: int, page_size: int = 16, *, fingerprint: str | None = None,
                  evict_batch_pages: int | None = None, tiers: LowerTier | None = None,
                  eviction: str = DEFAULT_POLICY) -> PagedKVCache:
        """A cache over a new pool of ``num_pages`` pages in the model's dtype and device, evicting by ``eviction`` (a
        name in ``mmcache.eviction.POLICIES``; ``InvalidConfig`` for an unknown one, before the pool is allocated),
        with a ``PrefixCache`` under ``fingerprint_for(model, page_size, fingerprint)`` and, if given, ``tiers``
        below its pool."""
        p = next(model.parameters())
        text = model.config.get_text_config(decoder=True)
        pool = PagePool(num_pages, kv_page_shape(model.config, page_size), p.dtype, p.device, eviction)
        prefix = PrefixCache(pool, cls.fingerprint_for(model, page_size, fingerprint),
                             evict_batch_pages=evict_batch_pages, vocab_size=text.vocab_size, tiers=tiers)
        return cls(prefix, model.config)

    # ---------------------------------------------------------------------------------------------- request lifecycle
    def admit(self, rid: Hashable, token_ids, media: Sequence = (), salt: bytes = b"",
              names: Sequence[int] | None = None) -> RequestState:
        """Start ``rid``: match its longest verified prefix (``PrefixCache.admit``) and gather those pages' K/V.

        Afterwards ``get_seq_length() == state.matched_tokens``: feed the model ``token_ids[matched_tokens:]``.
        """
        if self.rid is not None:
            raise InvalidRequest(f"request {self.rid!r} is still running on this cache: finish or abort it first")
        tokens = as_tokens(token_ids)
        state = self.prefix.admit(rid, tokens, media=media, salt=salt, names=names)
        m, k = state.matched_tokens, len(state.page_indices)
        if state.fetch is not None:  # pages copied up from the host tier or the store: read them once they arrived
            state.fetch.wait()
        try:
            self._reserve_staging(max(_MIN_CAPACITY, -(-tokens.size // self.page_size) * self.page_size))
            if m:
                pages = self.pool.data.index_select(0, torch.tensor(state.page_indices, device=self.pool.device))
                # [k, layers, 2, P, heads, dim] -> staging positions [0, m) laid out [layers, 2, heads, k, P, dim]
                self._kv[:, :, :, :m].unflatten(3, (k, self.page_size)).copy_(pages.permute(1, 2, 4, 0, 3, 5))
        except BaseException:  # e.g. no memory for the staging buffer: the request never started
            self.prefix.abort(rid)
            raise
        self.rid, self.seq_len, self._held, self._pages = rid, m, state.seq_len, state.page_indices
        return state

    def finish(self, rid: Hashable, output_ids=()) -> int:
        """End ``rid``: every full, written page of prompt + ``output_ids`` is in the index (see
        ``PrefixCache.finish``); returns how many pages the request indexed."""
        self._check(rid)
        added = self.prefix.finish(rid, output_ids)
        self._end()
        return added

    def abort(self, rid: Hashable, discard: bool = False) -> None:
        """End ``rid`` without indexing anything more (e.g. after an error mid-forward: the positions a failed forward
        was writing were never marked computed). Pages committed as they were written stay indexed, unless
        ``discard`` (see ``PrefixCache.abort``)."""
        self._check(rid)
        self.prefix.abort(rid, discard=discard)
        self._end()

    def state(self) -> RequestState:
        """The running request's ``RequestState`` (pages, held, matched and computed tokens)."""
        self._check(self.rid)
        return self.prefix.state(self.rid)

    # ---------------------------------------------------------------------------------------------- the hot path
    def _append(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write one layer's new K/V (``[1, heads, q, dim]``, post-RoPE) at ``[seq_len, seq_len + q)`` and return
        that layer's K/V for ``[0, seq_len + q)`` as views of the staging buffer."""
        start = self.seq_len
        end = start + key_states.shape[-2]
        if layer_idx == 0:
            self._reserve(key_states, end)
        keys, values = self._views[layer_idx]  # narrow/copy_: the cheapest way in and out of the buffer per step
        keys.narrow(2, start, end - start).copy_(key_states)
        values.narrow(2, start, end - start).copy_(value_states)
        if layer_idx == len(self.layers) - 1:
            self._write_through(start, end)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def _reserve(self, key_states: torch.Tensor, end: int) -> None:
        """Before the first write of a forward: check the request, grow its pages (whole pages, so a decode step
        grows once per page) and the staging buffer to hold ``end`` positions."""
        if self.rid is None:
            raise InvalidRequest("no request admitted: call admit() before running the model on this cache")
        if key_states.shape[0] != 1:
            raise InvalidRequest(f"PagedKVCache holds one request: batch size must be 1, got {key_states.shape[0]}")
        if end > self._held:
            state = self.prefix.grow(self.rid, -(-end // self.page_size) * self.page_size)
            self._held, self._pages = state.seq_len, state.page_indices
        if end > self._kv.shape[3]:
            self._reserve_staging(max(end, 2 * self._kv.shape[3]))

    def _write_through(self, start: int, end: int) -> None:
        """Copy positions ``[start, end)`` of every layer from the staging buffer into the request's pages, then mark
        them computed. One copy per page touched: one for a decode step."""
        P, data, kv = self.page_size, self.pool.data, self._kv
        if end - start == 1:
            data[self._pages[start // P], :, :, start % P] = kv[:, :, :, start]
        else:
            a = start
            while a < end:
                b = min(end, (a // P + 1) * P)
                data[self._pages[a // P], :, :, a % P:a % P + b - a] = kv[:, :, :, a:b].transpose(2, 3)
                a = b
        self.prefix.mark_computed(self.rid, end)
        self.seq_len = end

    # ---------------------------------------------------------------------------------------------- internals
    def _reserve_staging(self, capacity: int) -> None:
        """A staging buffer of at least ``capacity`` positions keeping the first ``seq_len``; it is kept across
        requests and only grows. Allocated outside inference mode, so any later mode may write it."""
        if self._kv is not None and self._kv.shape[3] >= capacity:
            return
        layers, _, _, heads, dim = self.pool.page_shape
        with torch.inference_mode(False):
            kv = torch.empty((layers, 2, heads, capacity, dim), dtype=self.pool.dtype, device=self.pool.device)
            views = [(kv[i, 0, None], kv[i, 1, None]) for i in range(layers)]  # [1, heads, capacity, dim] each
        if self.seq_len:
            kv[:, :, :, :self.seq_len] = self._kv[:, :, :, :self.seq_len]
        self._kv, self._views = kv, views

    def _check(self, rid: Hashable) -> None:
        if rid is None or rid != self.rid:
            raise InvalidRequest(f"request {rid!r} is not the one running on this cache ({self.rid!r})")

    def _end(self) -> None:
        self.rid, self.seq_len, self._held, self._pages = None, 0, 0, ()

