"""Replica affinity: the model-free router (rendezvous hashing below a queue threshold) and its M* conductor
adapter, driven on M*'s real ``WorkerGraph`` and ``RequestData`` objects (the conductor's constructor launches worker
processes and sockets, so the adapter's method runs on an instance built without it)."""

import inspect
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmcache import Fingerprint, page_names
from mmcache.errors import InvalidRequest
from mmcache.mstar.requirement import why_unavailable
from mmcache.routing import AffinityRouter, affinity_key, media_key, rendezvous_order

FP = Fingerprint("m", page_size=4)


def test_equal_prefixes_meet_and_the_key_is_the_first_pages():
    a = page_names(FP, list(range(8)) + [1, 2, 3, 4])
    b = page_names(FP, list(range(8)) + [9, 9, 9, 9])
    assert affinity_key(a, 2) == affinity_key(b, 2) and affinity_key(a, 3) != affinity_key(b, 3)
    assert affinity_key([], 1) is None
    r = AffinityRouter(range(4), threshold=5, key_pages=2)
    assert r.choose(a, [0] * 4) == r.choose(b, [0] * 4)


@given(st.integers(0, 2**64 - 1))
def test_rendezvous_moves_only_the_leaving_replicas_keys(key):
    replicas = ["r0", "r1", "r2", "r3", "r4"]
    before = replicas[rendezvous_order(key, replicas)[0]]
    for gone in replicas:
        rest = [r for r in replicas if r != gone]
        after = rest[rendezvous_order(key, rest)[0]]
        assert after == before or before == gone
    assert replicas[::-1][rendezvous_order(key, replicas[::-1])[0]] == before  # order of the list does not matter


def test_threshold_falls_back_to_random_and_unnamed_prompts_too():
    names = page_names(FP, list(range(8)))
    r = AffinityRouter(range(3), threshold=2, rng=random.Random(0))
    top = r.choose(names, [0, 0, 0])
    loads = [0, 0, 0]
    loads[top] = 2
    picks = {r.choose(names, loads) for _ in range(60)}
    assert picks == {0, 1, 2} and r.fallbacks == 60 and r.preferred == 1
    assert len({r.choose([], [0, 0, 0]) for _ in range(60)}) == 3


def test_bad_router_arguments_are_refused():
    for kw in ({"threshold": 0}, {"key_pages": 0}):
        with pytest.raises(InvalidRequest):
            AffinityRouter(range(2), **kw)
    with pytest.raises(InvalidRequest):
        AffinityRouter([])
    with pytest.raises(InvalidRequest):
        AffinityRouter(range(2)).choose([1], [0])


def test_media_key_follows_the_first_image_under_its_salt_and_falls_back_to_the_text_key():
    img, other = bytes(range(16)), bytes(range(1, 17))
    a, b = page_names(FP, [1] * 8), page_names(FP, [2] * 8)          # different text around one image
    r = AffinityRouter(range(64), threshold=10**6, key="media")
    assert r.route_key(a, [img, other]) == r.route_key(b, [img]) == media_key([img])
    assert media_key([img], b"tenant-a") != media_key([img], b"tenant-b") != media_key([img])
    assert media_key([other, img]) != media_key([img, other])         # the first item in prompt order
    assert r.route_key(a, []) == affinity_key(a) and media_key([]) is None
    assert AffinityRouter(range(4), key="text").route_key(a, [img]) == affinity_key(a)
    picks = {r.choose(page_names(FP, [i] * 8), [0] * 64, [img]) for i in range(50)}
    assert len(picks) == 1                                            # 50 texts, one image: one replica
    assert media_key([int.from_bytes(img, "little")]) == media_key([img])  # an int digest is its 16 bytes


def test_bad_media_and_salt_are_refused_before_anything_changes():
    r = AffinityRouter(range(3), key="media")
    for media, salt in ((b"\x01" * 16, b""), ("ab" * 8, b""), (["ab" * 8], b""), ([b""], b""), ([(0, b"x" * 16)], b""),
                        ([b"x" * 16], "tenant"), ([-1], b"")):
        with pytest.raises(InvalidRequest):
            r.choose([], [0, 0, 0], media, salt)
    with pytest.raises(InvalidRequest):
        AffinityRouter(range(3)).choose([1], [0, 0, 0], ["not a digest"])  # checked under the text key too
    assert r.preferred == r.fallbacks == 0
    with pytest.raises(InvalidRequest):
        AffinityRouter(range(2), key="image")


@given(st.binary(min_size=16, max_size=16), st.binary(max_size=8), st.integers(2, 7))
def test_rendezvous_on_media_keys_moves_only_the_leaving_replicas_keys(digest, salt, n):
    replicas = [f"r{i}" for i in range(n)]
    pick = lambda reps: reps[AffinityRouter(reps, threshold=10**6, key="media").choose(  # noqa: E731
        [], [0] * len(reps), [digest], salt)]
    before = pick(replicas)
    for gone in replicas:
        after = pick([r for r in replicas if r != gone])
        assert after == before or before == gone
    assert pick(replicas[::-1]) == before


def test_affinity_spreads_distinct_prefixes_over_every_replica():
    r = AffinityRouter(range(4), threshold=10**6)
    picks = [r.choose(page_names(FP, [i] * 4), [0] * 4) for i in range(400)]
    counts = np.bincount(picks, minlength=4)
    assert counts.min() > 60  # ~100 each


# ----------------------------------------------------------------- M*'s conductor
@pytest.fixture(scope="module")
def mstar():
    if why_unavailable() is not None:
        pytest.skip(why_unavailable())
    try:
        from mstar.conductor import conductor
        from mstar.graph.base import GraphNode
        from mstar.model.base import WorkerGraph
    except ImportError as e:
        pytest.skip(f"M*'s import dependencies are missing ({e}): pip install 'mmcache[mstar]'")
    from mmcache.mstar import conductor as mstar_routing  # mmcache's own: an import error here is a failure

    return conductor, GraphNode, WorkerGraph, mstar_routing


def _conductor(mstar, threshold):
    conductor, GraphNode, WorkerGraph, mr = mstar
    llm = WorkerGraph(section=GraphNode(name="llm", input_names={"x"}, outputs=[]), graph_walks={"prefill"},
                      ranks=[0, 1, 2, 3, 4, 5], tp_size=2, _group_id=0)          # 3 replicas of 2 TP ranks
    head = WorkerGraph(section=GraphNode(name="head", input_names={"x"}, outputs=[]), graph_walks={"decode"},
                       ranks=[0, 1, 2, 3, 4, 5], tp_size=2, _group_id=0)         # same group: same replica
    enc = WorkerGraph(section=GraphNode(name="enc", input_names={"x"}, outputs=[]), graph_walks={"prefill"},
                      ranks=[6, 7], _group_id=1)                                 # 2 single-rank replicas
    c = object.__new__(type("C", (mr.AffinityConductor,), {"threshold": threshold}))
    c.worker_graphs = {wg.worker_graph_id: wg for wg in (llm, head, enc)}
    c.requests = {}
    return c, llm, head, enc


def _live(conductor, assignment):
    return conductor.RequestData(persist_signals={}, persist_signal_ref_cnt={}, worker_graph_to_workers=assignment,
                                 all_worker_graph_ids=set(assignment), max_output_tokens=1, random_seed=0,
                                 resource_configs={})  # 0.2.1: a request's knobs are per resource


class _Body:
    def __init__(self, names, media=(), salt=None):
        self.model_kwargs = {"mmcache_route_names": names, "mmcache_route_media": list(media)}
        if salt is not None:
            self.model_kwargs["mmcache_salt"] = salt


def test_conductor_seam_is_the_one_the_adapter_replaces(mstar):
    conductor = mstar[0]
    assert list(inspect.signature(conductor.Conductor._assign_worker_graphs_to_workers).parameters) == ["self"]
    assert "self._assign_worker_graphs_to_workers()" in inspect.getsource(conductor.Conductor._do_ingest_request)


def test_conductor_places_equal_prefixes_on_one_replica_until_its_queue_is_full(mstar):
    conductor = mstar[0]
    c, llm, head, enc = _conductor(mstar, threshold=3)
    names = page_names(FP, list(range(16)))
    c._mmcache_body = _Body(names)
    first = c._assign_worker_graphs_to_workers()
    assert first[llm.worker_graph_id] == first[head.worker_graph_id]  # one replica per node group
    assert len(first[llm.worker_graph_id]) == 2 and len(first[enc.worker_graph_id]) == 1
    for i in range(3):
        assert c._assign_worker_graphs_to_workers() == first
        c.requests[f"r{i}"] = _live(conductor, first)
    np.random.seed(0)
    later = [c._assign_worker_graphs_to_workers()[llm.worker_graph_id] for _ in range(40)]
    assert len({tuple(x) for x in later}) == 3  # the preferred replica is full: M*'s random choice


def test_conductor_without_names_keeps_today_s_random_choice(mstar):
    c, llm, _, _ = _conductor(mstar, threshold=100)
    c._mmcache_body = _Body([])
    np.random.seed(1)
    assert len({tuple(c._assign_worker_graphs_to_workers()[llm.worker_graph_id]) for _ in range(40)}) == 3


def test_conductor_without_names_is_m_star_s_own_assignment(mstar):
    """No names: the same seed gives exactly the assignment 0.2.1's ``Conductor`` makes itself."""
    conductor = mstar[0]
    c, _, _, _ = _conductor(mstar, threshold=3)
    c._mmcache_body = _Body([])
    plain = object.__new__(conductor.Conductor)
    plain.worker_graphs, plain.requests = c.worker_graphs, {}
    for seed in range(5):
        np.random.seed(seed)
        ours = [c._assign_worker_graphs_to_workers() for _ in range(4)]
        np.random.seed(seed)
        assert ours == [plain._assign_worker_graphs_to_workers() for _ in range(4)]


def test_conductor_routes_by_the_first_media_digest_under_the_request_s_salt(mstar):
    c, llm, _, enc = _conductor(mstar, threshold=100)
    c.key = "media"
    img = bytes(range(16))
    placed = set()
    for i in range(12):  # twelve prompts, one image: one replica of every group
        c._mmcache_body = _Body(page_names(FP, [i] * 16), [img])
        a = c._assign_worker_graphs_to_workers()
        placed.add((tuple(a[llm.worker_graph_id]), tuple(a[enc.worker_graph_id])))
    assert len(placed) == 1
    salted = set()
    for k in range(24):  # the same image under many tenants: spread, not piled on one replica
        c._mmcache_body = _Body([], [img], salt=f"tenant{k}")
        salted.add(tuple(c._assign_worker_graphs_to_workers()[llm.worker_graph_id]))
    assert len(salted) == 3
    c._mmcache_body = _Body([], [img], salt=7)
    with pytest.raises(InvalidRequest):
        c._assign_worker_graphs_to_workers()
