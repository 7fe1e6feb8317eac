"""Replica affinity: the model-free router (rendezvous hashing below a queue threshold) and its M* conductor
adapter, driven on M*'s real ``WorkerGraph`` and ``RequestData`` objects (the conductor's constructor launches worker
processes and sockets, so the adapter's method runs on an instance built without it)."""

import inspect
import random

import numpy as np
import pytest

from mmcache.mstar.requirement import why_unavailable
from hypothesis import given, strategies as st

from mmcache import Fingerprint, page_names
from mmcache.errors import InvalidRequest
from mmcache.routing import AffinityRouter, affinity_key, rendezvous_order

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
        from mmcache.mstar import conductor as mstar_routing
    except ImportError as e:
        pytest.skip(f"M*'s import dependencies are missing ({e}): pip install 'mmcache[mstar]'")
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
    def __init__(self, names):
        self.model_kwargs = {"mmcache_route_names": names}


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
