"""Exactness side by side with a real peer: transformers' continuous-batching engine and its prefix sharing
(``workloads.peers.transformers_cb``), on the tiny Llama, against plain ``generate``.

- every configuration (peer sharing off, peer sharing on one and three in flight, mmcache's runner) generates what
  ``generate`` does, and both caches did reuse something;
- a forced collision: the peer's block hash made constant (monkeypatched here: that is the peer, not the thing under
  test) serves another prompt's KV and its outputs change; mmcache with every page name equal still verifies the
  tokens, matches nothing it should not, and its outputs do not change;
- two tenants with the same prompt: the peer shares between them (its hash has no salt); mmcache with salts does not;
- mmcache under the peer's engine evicts by the policy the driver names (the knee rows of the peer benchmark).
"""

import pytest

from mmcache.hf.paged_kv import PagedKVCache
from mmcache.hf.runner import serve

cb = pytest.importorskip("transformers.generation.continuous_batching",
                         reason="transformers has no continuous-batching engine (needs transformers >= 5)")
from conftest import ENGINE_NEW as NEW  # noqa: E402
from conftest import ENGINE_P as P  # noqa: E402
from workloads.peers.transformers_cb import Call, PeerEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def calls(prompts, sessions=None):
    return [Call(f"r{i}", sessions[i] if sessions else f"s{i}", p) for i, p in enumerate(prompts)]


def peer(model, prompts, *, share=True, inflight=1, sessions=None):
    with PeerEngine(model, share=share, page_size=P, num_blocks=128, max_batch_tokens=128, max_new_tokens=NEW) as e:
        return e.replay(calls(prompts, sessions), inflight=inflight)


def ours(model, prompts, *, salts=None, names=None):
    kv = PagedKVCache.for_model(model, num_pages=128, page_size=P)
    return [serve(model, kv, f"r{i}", p, max_new_tokens=NEW, salt=salts[i] if salts else b"",
                  names=names(p) if names else None) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("share,inflight", [(False, 1), (True, 1), (True, 3)])
def test_peer_generates_what_generate_does(tiny_llama, prompts, reference, share, inflight):
    out = peer(tiny_llama, prompts, share=share, inflight=inflight)
    assert [o.output_ids for o in out] == reference
    matched = [o.matched_tokens for o in out]
    assert (sum(matched) > 0) == share and all(o.ttft_s > 0 for o in out)


def test_mmcache_generates_what_generate_does(tiny_llama, prompts, reference):
    out = ours(tiny_llama, prompts)
    assert [s.output_ids for s in out] == reference
    assert [s.matched_tokens for s in out] == [0, 3 * P, 0, 4 * P, 0]


def test_peer_reads_its_counters_consistently(tiny_llama, prompts):
    """The matched tokens from its DEBUG line and the tokens its forwards were fed add up: every prompt token not
    matched is fed once, and every generated token but the last."""
    with PeerEngine(tiny_llama, share=True, page_size=P, num_blocks=128, max_batch_tokens=128,
                    max_new_tokens=NEW) as e:
        out = e.replay(calls(prompts))
        fed = e.fed_tokens
    assert fed == sum(len(p) - o.matched_tokens + NEW - 1 for p, o in zip(prompts, out))


def test_forced_collision_changes_the_peers_outputs_not_mmcaches(tiny_llama, prompts, reference, monkeypatch):
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    with monkeypatch.context() as m:
        m.setattr(cache_allocator, "compute_block_hash", lambda parent, tokens: 7)  # every block collides
        out = peer(tiny_llama, prompts)
    assert [o.output_ids for o in out] != reference, "a colliding hash served wrong KV, yet outputs did not change"
    assert any(o.matched_tokens for o, p in zip(out[2:], prompts[2:]))  # unrelated prompts 'matched'

    same_name = lambda p: [7] * (len(p) // P)  # noqa: E731  every page of every prompt gets the same name
    served = ours(tiny_llama, prompts, names=same_name)
    assert [s.output_ids for s in served] == reference
    assert served[2].matched_tokens == 0 and served[4].matched_tokens == 0  # verification refused the collision


def test_two_tenants_share_in_the_peer_not_in_mmcache_with_salts(tiny_llama, prompts, reference):
    same = [prompts[3], prompts[3], prompts[3]]  # tenant a, tenant b, tenant a again
    out = peer(tiny_llama, same, sessions=["a", "b", "a"])
    assert out[1].matched_tokens > 0, "the peer has no salt: tenant b reads tenant a's pages"

    served = ours(tiny_llama, same, salts=[b"tenant-a", b"tenant-b", b"tenant-a"])
    assert [s.matched_tokens for s in served] == [0, 0, (len(prompts[3]) - 1) // P * P]
    assert all(s.output_ids == reference[3] for s in served)


@pytest.mark.parametrize("policy", ["lru", "dip"])
def test_mmcache_under_the_peer_evicts_by_the_policy_named(tiny_llama, prompts, reference, policy):
    with PeerEngine(tiny_llama, share=True, page_size=P, num_blocks=128, max_batch_tokens=128, max_new_tokens=NEW,
                    mmcache=True, eviction=policy) as e:
        out = e.replay(calls(prompts))
        assert e.prefix_cache.pool.policy.name == policy
    assert [o.output_ids for o in out] == reference
    assert sum(o.matched_tokens for o in out) > 0
