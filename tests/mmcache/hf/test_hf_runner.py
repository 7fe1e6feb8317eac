"""The one runner (mmcache.hf.runner): request lifecycle, decode loop, uncached path; LLaVA tenancy and hashing
through it; the encoder base's Lookup; the fixtures' seeding rule."""

import pytest
import torch

import digests
from conftest import png_bytes
from encoders.llava import LlavaPrefill
from encoders.vision import CachedVisionEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.hf import runner
from mmcache.hf.paged_kv import PagedKVCache
from workloads import fixtures

P, NEW = 4, 3

pytestmark = pytest.mark.usefixtures("one_thread")


def ids(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- lifecycle ------------------------------------------------------------------------------------------------------
def test_a_failed_request_is_aborted_and_keeps_only_what_its_forwards_wrote(tiny_llama):
    kv = PagedKVCache.for_model(tiny_llama, num_pages=32, page_size=P)
    prompt = ids(13, 1)
    with pytest.raises(RuntimeError, match="boom"):
        with runner.request(kv, "bad", prompt, config=tiny_llama.config) as lease:
            runner.replay(tiny_llama, lease.cache, prompt, runner.chunk_spans(0, 8, P))
            raise RuntimeError("boom")
    assert kv.prefix.stats().requests_live == 0
    first = runner.serve(tiny_llama, kv, "first", prompt, max_new_tokens=NEW)
    assert first.matched_tokens == 8  # the 2 pages its finished forwards wrote were committed; nothing after
    want = runner.serve(tiny_llama, None, "cold", prompt, max_new_tokens=NEW, chunk_tokens=P)
    assert first.output_ids == want.output_ids
    kv.admit("bad-kv", prompt)
    kv.abort("bad-kv", discard=False)
    assert runner.serve(tiny_llama, kv, "again", prompt, max_new_tokens=NEW).matched_tokens == 12


def test_discard_drops_what_a_request_committed(tiny_llama):
    kv = PagedKVCache.for_model(tiny_llama, num_pages=32, page_size=P)
    prompt = ids(13, 2)
    kv.admit("bad", prompt)
    runner.replay(tiny_llama, kv, prompt, runner.chunk_spans(0, 12, P))
    assert kv.prefix.stats().pages_cached == 3                      # committed as written
    kv.abort("bad", discard=True)                                   # ...and dropped: say its KV is bad
    assert kv.prefix.stats().pages_cached == 0
    assert runner.serve(tiny_llama, kv, "next", prompt, max_new_tokens=NEW).matched_tokens == 0


def test_the_uncached_path_runs_the_same_schedule_and_gives_the_same_tokens(tiny_llama):
    kv = PagedKVCache.for_model(tiny_llama, num_pages=32, page_size=P)
    shared = ids(8, 2)
    runner.serve(tiny_llama, kv, "a", shared + ids(5, 3), max_new_tokens=NEW, index_output=False)
    on = runner.serve(tiny_llama, kv, "b", shared + ids(6, 4), max_new_tokens=NEW)
    off = runner.serve(tiny_llama, None, "b", shared + ids(6, 4), max_new_tokens=NEW, chunk_tokens=P)
    assert on.matched_tokens == 8 and off.matched_tokens == 0
    assert on.output_ids == off.output_ids and torch.equal(on.logits[-1], off.logits[-1])
    with runner.request(None, "c", [1, 2], config=tiny_llama.config) as lease:
        assert lease.matched_tokens == 0 and lease.cache.get_seq_length() == 0
    with pytest.raises(Exception, match="chunk_tokens"):
        runner.serve(tiny_llama, None, "d", [1, 2, 3])


def test_greedy_reports_every_token_and_never_feeds_the_last():
    fed, seen = [], []
    out = runner.greedy(0, lambda s: s + 1, lambda t: fed.append(t) or t * 10, 3,
                        on_token=lambda step, toks: seen.append((step, list(toks))))
    assert out == [1, 11, 111] and fed == [1, 11]
    assert seen == [(0, [1]), (1, [1, 11]), (2, [1, 11, 111])]
    assert runner.greedy(0, lambda s: s, lambda t: pytest.fail("fed"), 1) == [0]


def test_hooks_time_prefill_and_count_tokens(tiny_llama):
    stages, tokens = [], []

    class Stage:
        def __init__(self, name):
            stages.append(name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    runner.serve(tiny_llama, None, "t", ids(9, 5), max_new_tokens=NEW, chunk_tokens=P,
                 on_token=lambda step, out: tokens.append(step), stage=Stage)
    assert stages == ["prefill"] and tokens == list(range(NEW))


# -- LLaVA through the runner: tenancy and hashing -------------------------------------------------------------------
def test_two_salts_never_share_an_encoder_entry_and_one_salt_does(tiny_llava):
    model, processor = tiny_llava
    store = EncoderStore(1 << 22, 4096)
    kv = PagedKVCache.for_model(model, num_pages=256, page_size=P)
    llava = LlavaPrefill(model, processor, kv, store)
    image = png_bytes(1)
    served = {}
    for k, salt in enumerate([b"tenant-a", b"tenant-b", b"tenant-a"]):
        prompt = llava.prompt(ids(3 + k, 10 + k), image, ids(4, 20))  # different text first: no KV match
        served[k] = llava.serve(f"r{k}", prompt, max_new_tokens=1, salt=salt)
        assert served[k].matched_tokens == 0
    assert [served[k].encoder_hits for k in range(3)] == [0, 0, 1]  # b missed a's entry; a's second use hit
    assert store.stats().entries == 2 and store.stats().totals.hits == 1
    assert torch.equal(llava.encoder(image, salt=b"tenant-a"), llava.encoder(image, salt=b"tenant-b"))


def test_each_image_is_hashed_once_per_request(tiny_llava, monkeypatch):
    model, processor = tiny_llava
    llava = LlavaPrefill(model, processor, PagedKVCache.for_model(model, num_pages=256, page_size=P),
                         EncoderStore(1 << 22, 4096))
    prompt = llava.prompt(ids(5, 1), png_bytes(2), ids(3, 2), png_bytes(3), ids(4, 3))
    calls = []
    real = digests.image
    monkeypatch.setattr(digests, "image", lambda *a, **k: calls.append(1) or real(*a, **k))
    served = llava.serve("r", prompt, max_new_tokens=1)
    assert len(calls) == 2 and served.encoder_hits == 0


def test_encoder_lookup_says_where_the_value_came_from(tiny_llava):
    model, processor = tiny_llava
    image = png_bytes(4)
    plain = CachedVisionEncoder(model, processor, None)
    assert plain.lookup(image).source == "computed" and not plain.lookup(image).hit
    cached = CachedVisionEncoder(model, processor, EncoderStore(1 << 22, 4096), fingerprint=plain.fingerprint)
    digest = cached.digest(image)
    first, second = cached.lookup(image, digest=digest), cached.lookup(image)
    assert (first.source, second.source) == ("computed", "store") and second.hit
    assert torch.equal(first.value, second.value) and torch.equal(first.value, plain(image))
    assert cached.key(image, digest=digest) == cached.key(image)


# -- fixtures --------------------------------------------------------------------------------------------------------
def test_fixtures_never_touch_the_global_rng_and_reuse_saved_folders(tmp_path):
    torch.manual_seed(1234)
    want = torch.rand(3)
    torch.manual_seed(1234)
    built = []
    with fixtures.seeded():
        a = torch.rand(2)
    folder = fixtures.saved(tmp_path, "thing", "key", lambda f: built.append(torch.rand(2)))
    assert torch.equal(torch.rand(3), want)  # the caller's stream is where it was
    with fixtures.seeded():
        assert torch.equal(torch.rand(2), a)
    assert fixtures.saved(tmp_path, "thing", "key", lambda f: pytest.fail("rebuilt")) == folder
    assert folder.is_dir() and len(built) == 1 and torch.equal(built[0], a)
