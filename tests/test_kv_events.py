"""KV events for external routers over a real ZMQ socket on 127.0.0.1: a subscriber decodes vLLM-format batches and
rebuilds the set of stored pages, which equals the index's under eviction, a discard and a clear, and with pages
copied up from a store; media digests and the salt ride in the extra keys; parents are always stored before their
children."""

import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.errors import InvalidRequest
from mmcache.kv_events import KVEventPublisher
from mmcache.tiers import MemoryStore, StoreTier, TierStack

P = 4


class Router:
    """What an external KV-aware router keeps: block hash -> (parent, token ids, extra keys)."""

    def __init__(self, endpoint):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.blocks, self.seqs, self.orphans = {}, [], 0

    def drain(self, timeout=2.0):
        while self.sock.poll(int(timeout * 1000)):
            _topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            _ts, events = msgpack.unpackb(payload)[:2]
            for ev in events:
                if ev[0] == "BlockStored":
                    _, hashes, parent, tokens, size, _lora, medium, _name, extra = ev
                    assert size == P and len(tokens) == len(hashes) * P and medium == "CPU"
                    for i, h in enumerate(hashes):
                        up = parent if i == 0 else hashes[i - 1]
                        self.orphans += up is not None and up not in self.blocks
                        self.blocks[h] = (up, tokens[i * P:(i + 1) * P], extra[i])
                elif ev[0] == "BlockRemoved":
                    for h in ev[1]:
                        del self.blocks[h]
                else:
                    assert ev == ["AllBlocksCleared"]
                    self.blocks.clear()
            timeout = 0.2


def serve(cache, rid, tokens, media=(), salt=b""):
    state = cache.admit(rid, tokens, media=media, salt=salt)
    cache.grow(rid, len(tokens))
    cache.mark_computed(rid, len(tokens))
    cache.finish(rid)
    return state


@pytest.fixture
def wired():
    fp = Fingerprint(model="events", page_size=P)
    pub = KVEventPublisher("tcp://127.0.0.1:*", P, medium="CPU", max_batch=8)
    router = Router(pub.endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the publisher before traffic starts
    cache = PrefixCache(PagePool(24, (P,), torch.float32), fp, evict_batch_pages=2, observer=pub)
    yield cache, pub, router
    pub.close()
    router.sock.close(linger=0)


def indexed_names(cache):
    v = cache.index.tier_view()
    return {int(n) for n in v.name[np.flatnonzero(cache.index.indexed)]}


def test_a_subscriber_rebuilds_the_index_under_eviction_discard_and_clear(wired):
    cache, pub, router = wired
    rng = np.random.default_rng(3)
    systems = [rng.integers(1, 500, 3 * P).tolist() for _ in range(3)]
    for i in range(60):  # shared prefixes, distinct tails: a 24-page pool evicts all the time
        serve(cache, f"r{i}", systems[i % 3] + rng.integers(1, 500, int(rng.integers(1, 4)) * P + 1).tolist())
    assert cache.stats().evicted_pages > 0
    assert pub.flush() and router.drain() is None
    assert set(router.blocks) == indexed_names(cache) and router.orphans == 0
    cache.admit("bad", systems[0] + [7] * (2 * P + 1))
    cache.grow("bad", 5 * P + 1)
    cache.mark_computed("bad", 5 * P + 1)
    cache.abort("bad", discard=True)  # its pages (and descendants) leave the index
    assert pub.flush() and router.drain() is None
    assert set(router.blocks) == indexed_names(cache)
    cache.clear()
    assert pub.flush() and router.drain() is None and router.blocks == {}
    assert router.seqs == list(range(len(router.seqs))) and pub.counters["dropped"] == 0


def test_media_digests_and_the_salt_ride_in_the_extra_keys(wired):
    cache, pub, router = wired
    digest = bytes(range(16))
    tokens = list(range(1, 3 * P + 2))
    serve(cache, "img", tokens, media=[(P + 1, digest)], salt=b"tenant")
    assert pub.flush() and router.drain() is None
    by_depth = sorted(router.blocks.values(), key=lambda b: b[0] is not None)
    extras = [b[2] for b in router.blocks.values()]
    assert ["salt", b"tenant".hex()] in by_depth[0][2]
    mm = [e for e in extras if e and e[0][0] == "mm"]
    assert len(mm) == 1 and mm[0][0][1] == ((P + 1).to_bytes(8, "little") + digest).hex()


def test_publisher_arguments_are_checked():
    with pytest.raises(InvalidRequest):
        KVEventPublisher("tcp://127.0.0.1:*", 0)
    with pytest.raises(InvalidRequest):
        KVEventPublisher("127.0.0.1:5557", 4)


def test_pages_copied_up_from_the_store_are_stored_events_too(wired):
    _, pub, router = wired
    fp = Fingerprint(model="events", page_size=P)
    shared = MemoryStore(64)

    def cache(observer=None):
        return PrefixCache(PagePool(24, (P,), torch.float32), fp, observer=observer,
                           tiers=TierStack(fp, store=StoreTier(shared, publish_async=False, deadline_s=None)))
    tokens = list(range(1, 4 * P + 2))
    serve(cache(), "a", tokens)               # another instance published 4 pages
    b = cache(pub)
    assert b.admit("b", tokens).matched_tokens == 4 * P
    assert pub.flush() and router.drain() is None
    assert set(router.blocks) == indexed_names(b) and len(router.blocks) == 4 and router.orphans == 0
