"""The shared tier on a real Mooncake Store (a master started here on free loopback ports): instance A (its own
process and device pool) computes and publishes a prefix; instance B, which never saw it, hits it through the store
with logits equal to its own uncached run. A killed master turns lookups into misses with no error reaching a
request and nothing wrong served; a restarted master is used again. Payloads are verified before use."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from conftest import random_tokens
from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.hf.paged_kv import PagedKVCache
from mmcache.hf.runner import chunk_spans, replay, serve
from mmcache.tiers import MemoryStore, StoreTier, TierStack, mooncake
from mooncake_master import MooncakeMaster

P, NEW = 4, 5
WHY = mooncake.available()
needs_mooncake = pytest.mark.skipif(WHY is not None, reason=f"Mooncake Store cannot run here: {WHY}")
pytestmark = pytest.mark.usefixtures("one_thread")





@pytest.fixture
def master():
    with MooncakeMaster() as m:
        yield m


@pytest.fixture
def instance(master):
    """``instance(model, probe_s)``: a PagedKVCache with a store tier on ``master``; its client is closed after the
    test, so no reconnecting client outlives it."""
    clients, stores = [], []

    def make(model, probe_s=5.0):
        clients.append(mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 64 << 20, 32 << 20))
        store = StoreTier(clients[-1], probe_s=probe_s)
        stores.append(store)
        kv = PagedKVCache.for_model(model, num_pages=32, page_size=P,
                                    tiers=TierStack(PagedKVCache.fingerprint_for(model, P), store=store))
        return kv, store

    yield make
    for store in stores:
        store.close()  # its publisher stops before the client it calls goes
    for client in clients:
        client.close()


def uncached(model, prompt, prefix_schedule, got):
    """The uncached run of ``got``'s schedule: the spans that computed its matched prefix, then its own."""
    prefix = [s for s in prefix_schedule if s[1] <= got.matched_tokens]
    want = replay(model, DynamicCache(config=model.config), prompt,
                  prefix + [s for s in got.spans if s[1] <= len(prompt)], max_new_tokens=NEW)
    assert want.output_ids == got.output_ids
    assert all(torch.equal(x, y) for x, y in zip(want.logits[len(prefix):], got.logits))


@pytest.mark.slow
@needs_mooncake
def test_instance_b_hits_what_instance_a_published(llama_folder, master, instance):
    first = random_tokens(13, 1)
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    a = subprocess.Popen([sys.executable, str(root / "tests" / "mooncake_instance.py"), str(llama_folder),
                          master.rpc_address, master.metadata_url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        a.stdin.write(json.dumps({"prompt": first, "page_size": P, "new": NEW}) + "\n")
        a.stdin.flush()
        published = json.loads(a.stdout.readline())
        written = (len(first) + NEW - 1) // P
        assert published["published"] == written
        model = LlamaForCausalLM.from_pretrained(llama_folder, attn_implementation="eager", dtype=torch.float32).eval()
        kv, store = instance(model)
        second = first + published["output_ids"] + random_tokens(6, 3)
        got = serve(model, kv, "b", second, max_new_tokens=NEW, chunk_tokens=P)
        assert got.matched_tokens == written * P and store.counters["hit_pages"] == written
        a_schedule = chunk_spans(0, len(first), P) + [(i, i + 1) for i in range(len(first), written * P)]
        uncached(model, second, a_schedule, got)
    finally:
        a.stdin.close()
        a.wait(30)


@pytest.mark.slow
@needs_mooncake
def test_a_dead_master_is_a_miss_and_a_restarted_one_is_used_again(llama_folder, master, instance):
    model = LlamaForCausalLM.from_pretrained(llama_folder, attn_implementation="eager", dtype=torch.float32).eval()
    kv, store = instance(model, probe_s=0.5)
    first = random_tokens(13, 5)
    a = serve(model, kv, "a", first, max_new_tokens=NEW, chunk_tokens=P)
    assert store.flush(30) and store.counters["published_pages"] == 4
    master.stop()
    kv.prefix.clear()  # the device forgets: only the store could answer now
    started = time.perf_counter()
    got = serve(model, kv, "b", first + a.output_ids, max_new_tokens=NEW, chunk_tokens=P)
    assert got.matched_tokens == 0 and time.perf_counter() - started < 2.0  # a miss, at once, no error
    assert store.flush(30)
    master.start()
    deadline = time.monotonic() + 20  # the client reconnects by itself; the tier probes again every probe_s
    while True:
        time.sleep(0.6)
        kv.prefix.clear()
        c = serve(model, kv, "c", first, max_new_tokens=NEW, chunk_tokens=P)  # computes and publishes again
        assert store.flush(30) and c.matched_tokens == 0
        kv.prefix.clear()
        got = serve(model, kv, "d", first + c.output_ids, max_new_tokens=NEW, chunk_tokens=P)
        if got.matched_tokens or time.monotonic() > deadline:
            break
    assert got.matched_tokens == 16, store.counters
    uncached(model, first + c.output_ids, chunk_spans(0, len(first), P) + [(i, i + 1) for i in range(13, 16)], got)


def test_a_store_page_is_verified_before_use():
    fp = Fingerprint(model="v", page_size=P)
    shared = MemoryStore(64)

    def cache(fingerprint=fp):
        store = StoreTier(shared, publish_async=False)
        return PrefixCache(PagePool(8, (P,), torch.float32), fingerprint, evict_batch_pages=1,
                           tiers=TierStack(fingerprint, store=store))

    def publish():
        a = cache()
        a.admit("a", list(range(1, 10)), salt=b"t")
        s = a.grow("a", 9)
        for j, p in enumerate(s.page_indices):
            a.pool.data[p] = float(j + 1)
        a.mark_computed("a", 9)
        a.finish("a")

    publish()
    b = cache()
    assert b.admit("same", list(range(1, 10)), salt=b"t").matched_tokens == 8
    assert b.admit("other salt", list(range(1, 10))).matched_tokens == 0
    other = cache(Fingerprint(model="other weights", page_size=P))
    names = [n for n in list(shared._data)]
    assert other.admit("x", list(range(1, 10)), names=[int(k.split("/")[1], 16) for k in names[:2]],
                       salt=b"t").matched_tokens == 0  # the same names under another fingerprint: rejected
    assert other.tiers.store.counters["rejected"] == 1 and names[0] not in shared._data  # and removed
    publish()
    key = names[0]
    shared._data[key] = shared._data[key][:-4] + b"\0\0\0\0"  # corrupt the bytes: the checksum refuses them
    c = cache()
    assert c.admit("corrupt", list(range(1, 10)), salt=b"t").matched_tokens == 0
    assert c.tiers.store.counters["rejected"] == 1
