"""KV events for external routers over a real ZMQ socket on 127.0.0.1: a subscriber decodes vLLM-format batches and
rebuilds the set of stored pages, which equals the index's under eviction, a discard and a clear, and with pages
copied up from a store; media identifiers ride in the extra keys of every page an item overlaps and the salt on the
first page, as vLLM's do; encoder outputs stored and dropped come on their own socket under their own topic, so a
subscriber to every topic on the KV endpoint never sees one; parents are always stored before their children.
(Each consumer's own format: ``tests/mmcache/events/test_kv_event_consumers.py``.)"""

import time

import numpy as np
import pytest
import torch
import zmq

from mmcache import EncoderKey, EncoderStore, Fingerprint, PagePool, PrefixCache
from mmcache.errors import InvalidRequest
from mmcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EncoderOutputRemoved,
    EncoderOutputStored,
    decode_batch,
    media_identifier,
)
from mmcache.events.publisher import encoder_endpoint_beside
from mmcache.kv_events import DEFAULT_ENCODER_TOPIC, KVEventPublisher
from mmcache.tiers import MemoryStore, StoreTier, TierStack

P = 4


def subscriber(*endpoints):
    """A SUB socket subscribed to every topic on each of ``endpoints``."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    for endpoint in endpoints:
        sock.connect(endpoint)
    return sock


class Router:
    """What an external KV-aware router keeps: block hash -> (parent, token ids, extra keys); and the encoder outputs
    it was told of, when it also connects to the publisher's encoder endpoint."""

    def __init__(self, *endpoints):
        self.sock = subscriber(*endpoints)
        self.blocks, self.seqs, self.orphans, self.outputs = {}, [], 0, []

    def drain(self, timeout=2.0):
        while self.sock.poll(int(timeout * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            batch = decode_batch(payload)
            assert batch.data_parallel_rank == 0
            if topic == DEFAULT_ENCODER_TOPIC.encode():
                self.outputs.extend(batch.events)
                continue
            assert topic == b""
            self.seqs.append(int.from_bytes(seq, "big"))
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    hashes, tokens = ev.block_hashes, ev.token_ids
                    assert ev.block_size == P and len(tokens) == len(hashes) * P and ev.medium == "CPU"
                    for i, h in enumerate(hashes):
                        up = ev.parent_block_hash if i == 0 else hashes[i - 1]
                        self.orphans += up is not None and up not in self.blocks
                        self.blocks[h] = (up, tokens[i * P:(i + 1) * P], ev.extra_keys[i])
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        del self.blocks[h]
                else:
                    assert isinstance(ev, AllBlocksCleared)
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
    router = Router(pub.endpoint, pub.encoder_endpoint)
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


def test_media_identifiers_ride_on_every_page_an_item_overlaps_and_the_salt_on_the_first(wired):
    cache, pub, router = wired
    digest = bytes(range(16))
    tokens = list(range(1, 4 * P + 2))
    pub.describe_media(digest, 2 * P)  # placeholders P+1 .. 3P: pages 1, 2 and 3
    serve(cache, "img", tokens, media=[(P + 1, digest)], salt=b"tenant")
    assert pub.flush() and router.drain() is None
    by_depth = sorted(router.blocks.values(), key=lambda b: b[1][0])
    ident = media_identifier(digest)
    assert len(ident) == 64 and ident.startswith(digest.hex())
    assert [b[2] for b in by_depth] == [("tenant",), ((ident, 1),), ((ident, 1 - P),), ((ident, 1 - 2 * P),)]


def test_an_item_never_described_rides_on_its_first_page_only(wired):
    cache, pub, router = wired
    digest = bytes(range(1, 17))
    serve(cache, "img", list(range(1, 3 * P + 2)), media=[(P + 1, digest)])
    assert pub.flush() and router.drain() is None
    keys = [b[2] for b in sorted(router.blocks.values(), key=lambda b: b[1][0])]
    assert keys == [None, ((media_identifier(digest), 1),), None] and pub.unsized_media == 1


def test_encoder_outputs_stored_and_dropped_come_on_their_own_socket_under_their_own_topic(wired):
    _, pub, router = wired
    store = EncoderStore(capacity_bytes=64, page_bytes=16, observer=pub)
    keys = [EncoderKey(bytes([k]) * 16, "vit@0", "image", b"t" if k else b"") for k in range(3)]
    for k in keys:
        store.put(k, torch.zeros(32, dtype=torch.uint8))  # two fit: the third evicts the first
    assert pub.flush() and router.drain() is None
    got = [(type(e), e.identifier, e.encoder, e.cache_salt) for e in router.outputs]
    ident = [media_identifier(k.digest) for k in keys]
    assert got == [(EncoderOutputStored, ident[0], "vit@0", None), (EncoderOutputStored, ident[1], "vit@0", "t"),
                   (EncoderOutputRemoved, ident[0], "vit@0", None), (EncoderOutputStored, ident[2], "vit@0", "t")]
    assert router.outputs[0].nbytes == 32 and router.outputs[0].digest == keys[0].digest.hex()


def test_a_subscriber_to_every_topic_on_the_kv_endpoint_never_gets_an_encoder_message():
    """Dynamo's relay subscribes to "" on the KV endpoint: it must see vLLM's stream alone, its sequence numbers
    counting up, however the KV and encoder events interleave."""
    pub = KVEventPublisher("tcp://127.0.0.1:*", P, medium="CPU", max_batch=2)
    assert pub.encoder_endpoint != pub.endpoint and pub.encoder_endpoint.startswith("tcp://127.0.0.1:")
    relay = subscriber(pub.endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner
    cache = PrefixCache(PagePool(24, (P,), torch.float32), Fingerprint(model="events", page_size=P), observer=pub)
    store = EncoderStore(capacity_bytes=64, page_bytes=16, observer=pub)
    for i in range(6):  # KV and encoder events interleaved
        serve(cache, f"r{i}", [i + 1] * (2 * P + 1))
        store.put(EncoderKey(bytes([i]) * 16, "vit@0", "image"), torch.zeros(32, dtype=torch.uint8))
    assert pub.flush()
    got = []
    while relay.poll(1000):
        got.append(relay.recv_multipart())
    pub.close()
    relay.close(linger=0)
    assert got and {topic for topic, _, _ in got} == {b""}
    assert [int.from_bytes(seq, "big") for _, seq, _ in got] == list(range(len(got)))
    assert {type(e) for _, _, payload in got for e in decode_batch(payload).events} == {BlockStored}


@pytest.mark.parametrize("endpoint, beside", [("tcp://127.0.0.1:5557", "tcp://127.0.0.1:*"),
                                              ("tcp://[::1]:5557", "tcp://[::1]:*"),
                                              ("ipc:///tmp/kv.sock", "ipc:///tmp/kv.sock-encoder"),
                                              ("inproc://kv", "inproc://kv-encoder")])
def test_the_encoder_endpoint_is_beside_the_kv_one_by_default(endpoint, beside):
    assert encoder_endpoint_beside(endpoint) == beside


def test_publisher_arguments_are_checked():
    with pytest.raises(InvalidRequest):
        KVEventPublisher("tcp://127.0.0.1:*", 0)
    with pytest.raises(InvalidRequest):
        KVEventPublisher("127.0.0.1:5557", 4)
    with pytest.raises(InvalidRequest):
        KVEventPublisher("tcp://127.0.0.1:*", 4, encoding="json")
    taken = KVEventPublisher("tcp://127.0.0.1:*", 4)
    with pytest.raises(InvalidRequest, match="cannot bind the encoder-event socket"):
        KVEventPublisher("tcp://127.0.0.1:*", 4, encoder_endpoint=taken.endpoint)
    taken.close()


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
