"""Authenticated store entries: with a deployment key, a writer that changes a page's bytes and recomputes the plain
checksum is refused (a miss, counted as a MAC failure) and its entry removed, so the next publish stores the real
page; without a key the same forgery is served, which is the trust model the README states (a keyless store trusts
every writer)."""

import numpy as np
import torch
import xxhash

from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.tiers import MemoryStore, StoreTier, TierStack
from mmcache.tiers.page_format import HEAD, MAC_BYTES

P = 4
KEY = b"deployment-key-0123456789abcdef"
TOKENS = list(range(1, 10))


def cache(shared, key):
    fp = Fingerprint(model="auth", page_size=P)
    store = StoreTier(shared, publish_async=False, deadline_s=None, key=key)
    return PrefixCache(PagePool(8, (P,), torch.float32), fp, evict_batch_pages=1, tiers=TierStack(fp, store=store))


def publish(shared, key):
    a = cache(shared, key)
    a.admit("a", TOKENS)
    s = a.grow("a", len(TOKENS))
    for j, p in enumerate(s.page_indices):
        a.pool.data[p] = float(j + 1)
    a.mark_computed("a", len(TOKENS))
    a.finish("a")


def forge(payload: bytes, keyed: bool) -> bytes:
    """Change the page bytes and recompute the plain checksum, as a writer without the key can (an old MAC stays)."""
    tail = MAC_BYTES if keyed else 0
    body, mac = payload[:len(payload) - tail], payload[len(payload) - tail:]
    data = np.full(P, 666.0, dtype=np.float32).tobytes()
    body = body[:len(body) - len(data)] + data
    head = list(HEAD.unpack_from(body))
    head[-1] = xxhash.xxh3_64_intdigest(data)
    return HEAD.pack(*head) + body[HEAD.size:] + mac


def read(shared, key):
    b = cache(shared, key)
    state = b.admit("b", TOKENS)
    return state, b


def test_a_forged_entry_is_a_counted_miss_with_a_key():
    shared = MemoryStore(64)
    publish(shared, KEY)
    state, b = read(shared, KEY)
    assert state.matched_tokens == 8  # genuine entries verify
    first = next(iter(shared._data))
    shared._data[first] = forge(shared._data[first], keyed=True)
    state, b = read(shared, KEY)
    assert state.matched_tokens == 0 and b.tiers.store.counters["mac_failures"] == 1
    assert first not in shared._data and b.tiers.store.counters["refused_removed"] == 1
    publish(shared, KEY)  # the real page again: stored, served
    state, b = read(shared, KEY)
    assert state.matched_tokens == 8
    state, b = read(shared, b"another-key-0123456789abcdef")  # the wrong key: every entry fails (and is removed:
    assert state.matched_tokens == 0 and b.tiers.store.counters["mac_failures"] == 1  # one store, one key)


def test_keyless_and_keyed_entries_never_mix_and_keyless_trusts_every_writer():
    shared = MemoryStore(64)
    publish(shared, None)
    state, b = read(shared, KEY)  # a keyed reader refuses keyless entries
    assert state.matched_tokens == 0 and b.tiers.store.counters["mac_failures"] == 1  # (and removes what it read)
    publish(shared, None)
    first = next(iter(shared._data))
    shared._data[first] = forge(shared._data[first], keyed=False)
    state, b = read(shared, None)  # without a key the forgery passes the checksum: the documented trust model
    assert state.matched_tokens == 8 and float(b.pool.data[state.page_indices[0]][0]) == 666.0
