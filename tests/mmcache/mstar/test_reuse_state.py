"""The reuse state machine of M*'s KV resource (``mmcache.mstar.reuse_state.ReuseState``) driven without M*: a plain
``PagePool``, a dict of ``Stream``s for M*'s stream table, and a host that writes what each step was fed. Feed (match
and cut), write, commit (index the pages that filled), a second request that shares them, and a step retried after
an allocation failure. ``test_runs_with_mstar_blocked`` runs these in a process where ``import mstar`` fails."""

import subprocess
import sys
from pathlib import Path

import torch

from mmcache.mstar.reuse_state import ReuseState, Stream
from mmcache.names import Fingerprint
from mmcache.pool import PagePool

P, LABEL = 4, "main"


class Host:
    """What M*'s ``KVManager`` does around the state machine, reduced to what it reads: a stream table whose
    requests are ingested before they are fed, and steps that write what they were fed (pages from the pool, one owner
    each) or, refused (``AllocationFailed``), nothing."""

    def __init__(self, pages: int = 64):
        self.pool = PagePool(pages, page_shape=(1,))
        self.streams: dict = {}
        self.state = ReuseState(self.pool, P, self.streams, root=Fingerprint(model="toy@0", page_size=P, extra="kv"),
                                reused=frozenset({LABEL}))

    def stream(self, rid: str) -> Stream:
        return self.streams[rid][LABEL]

    def ingest(self, rid: str) -> None:
        self.streams[rid] = {}

    def write(self, rid: str, n: int) -> None:
        """The step ran: ``n`` positions of ``rid``'s stream are written, then M* commits."""
        s = self.stream(rid)
        need = -(-(s.stored_len + n) // P) - len(s.page_indices)
        if need > 0:
            s.page_indices += self.pool.alloc(need)
        s.stored_len += n
        s.generation += 1
        self.state.commit()

    def prefill(self, rid: str, ids: list[int]) -> int:
        """Feed ``ids`` and write what the cut leaves; returns the cut."""
        cut = self.state.feed(rid, LABEL, torch.tensor(ids))
        self.write(rid, len(ids) - cut)
        return cut

    def decode(self, tokens: dict[str, int]) -> None:
        """One decode step: each request's one sampled id (a one-element tensor, as M* hands them), fed at once."""
        assert self.state.feed_rows(LABEL, {rid: torch.tensor([t]) for rid, t in tokens.items()}) == []
        for rid in tokens:
            s = self.stream(rid)
            if s.stored_len + 1 > len(s.page_indices) * P:
                s.page_indices += self.pool.alloc(1)
            s.stored_len += 1
        self.state.commit()

    def remove(self, rid: str) -> None:
        self.state.forget(rid, finished=True)
        self.pool.release(self.stream(rid).page_indices)
        del self.streams[rid]

    def cached(self) -> int:
        return self.state.lifecycle(LABEL).stats(0, 0).pages_cached


def test_feed_settle_commit_and_a_second_request_reuses_the_pages():
    host, prompt = Host(), list(range(10, 20))              # 10 ids: two full pages and half a third
    host.ingest("a")
    assert host.prefill("a", prompt) == 0                   # nothing cached yet
    named = host.state.named[LABEL]["a"]
    assert named.named == 10 and named.pending is None       # settled at the commit: the feed was written exactly
    assert host.cached() == 2                                # the two full prompt pages, indexed as written
    host.decode({"a": 7})
    assert host.cached() == 2 and named.due == 12            # position 10 written; the page fills at 12
    host.decode({"a": 8})
    assert host.cached() == 3 and named.generated.tolist() == [7, 8]  # the generated page, named from the fed ids
    a_pages = list(host.stream("a").page_indices)

    host.ingest("b")                                         # a still runs: b shares the three pages it committed
    assert host.prefill("b", prompt + [7, 8, 1, 2]) == 12   # 3 pages matched, the last two ids computed
    b = host.stream("b")
    assert b.page_indices[:3] == a_pages[:3] and b.stored_len == 14
    assert all(host.pool.owners(p) == 3 for p in a_pages[:3])  # a, b and the index
    stats = host.state.lifecycle(LABEL).stats(0, 0)
    assert stats.hits == 1 and stats.hit_tokens == 12

    host.remove("a")
    host.remove("b")
    assert host.pool.num_free + host.cached() == host.pool.num_pages  # the index keeps its pages, nothing leaks
    assert not host.state.named[LABEL] and not host.state.due

    host.ingest("c")                                         # after both left, a third request still matches them
    assert host.prefill("c", prompt + [7, 8, 3, 4]) == 12


def test_pages_decode_steps_fill_wait_for_a_few_steps_worth_and_no_longer_than_the_next_lookup():
    """A commit leaves the pages decode steps filled for a few steps' worth to index at once; a lookup (another
    request's feed), a read of the index or the request leaving indexes them first."""
    host = Host()
    host.ingest("a")
    host.prefill("a", list(range(10, 18)))                  # two full prompt pages, indexed at once
    for t in (1, 2, 3, 4):                                   # the third page fills
        host.decode({"a": t})
    assert host.state.due_rows and host.state.lifecycles[LABEL].stats(0, 0).pages_cached == 2  # waiting
    host.ingest("b")
    assert host.prefill("b", list(range(10, 18)) + [1, 2, 3, 4, 9, 9]) == 12  # the lookup indexed it first
    for t in (5, 6, 7, 8):                                   # a's fourth page fills, then a leaves
        host.decode({"a": t})
    host.remove("a")
    assert not host.state.due_rows and host.state.lifecycles[LABEL].stats(0, 0).pages_cached == 4


def test_a_prefill_retried_after_an_allocation_failure_is_cut_at_what_is_held():
    host, prompt = Host(), list(range(30, 39))              # 9 ids: two full pages
    host.ingest("a")
    host.prefill("a", prompt)
    host.ingest("b")
    fed = prompt[:8] + [1, 2, 3, 4, 5]
    assert host.state.feed("b", LABEL, torch.tensor(fed)) == 8   # two pages held; its step is refused (no write)
    host.state.commit()                                      # M*'s commit of a step without b: nothing of b settles
    pending = host.state.named[LABEL]["b"].pending
    assert host.stream("b").stored_len == 8 and pending[0] == 8 and pending[2] == 5  # announced, not written
    assert host.state.feed("b", LABEL, torch.tensor(fed)) == 8   # the prompt fed again: cut at what is held
    assert host.state.lifecycle(LABEL).stats(0, 0).hits == 1     # and not looked up (or counted) again
    host.write("b", 5)
    assert host.state.named[LABEL]["b"].named == 13 and host.cached() == 3  # b's third page, named and indexed
    host.ingest("c")
    assert host.prefill("c", fed[:12] + [9, 9]) == 12


def test_a_write_no_feed_named_stops_the_indexing():
    """A walk the state machine was not told about (embeddings without marks: ``token_ids`` None) writes KV no ids
    describe: nothing from its first position on is indexed, and a later request with the same ids matches only what
    came before it."""
    host, prompt = Host(), list(range(50, 56))              # 6 ids: one full page
    host.ingest("a")
    host.prefill("a", prompt)
    assert host.state.feed("a", LABEL, None) == 0            # nothing announced
    host.write("a", 6)                                       # positions 6..11: pages 1 and 2 fill
    assert host.state.feed("a", LABEL, torch.tensor([1, 2, 3, 4])) == 0  # settles: the stream moved unannounced
    host.write("a", 4)                                       # positions 12..15: page 3 fills
    assert not host.state.named[LABEL]["a"].covered and host.cached() == 1
    host.ingest("b")
    assert host.prefill("b", prompt + [0] * 8) == P          # only the prompt's full page


def test_runs_with_mstar_blocked():
    """The state machine imports nothing of M*: the tests above pass in a process where ``import mstar`` fails."""
    here = Path(__file__).parent
    code = ("import sys; sys.modules['mstar'] = None; sys.path.insert(0, sys.argv[1]); import test_reuse_state as t\n"
            "for name in ('test_feed_settle_commit_and_a_second_request_reuses_the_pages',\n"
            "             'test_a_prefill_retried_after_an_allocation_failure_is_cut_at_what_is_held',\n"
            "             'test_a_write_no_feed_named_stops_the_indexing'):\n"
            "    getattr(t, name)()\n"
            "assert not [m for m in sys.modules if m.startswith('mstar.')], 'M* was imported'\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True, timeout=300,
                         cwd=here.parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_page_names_follow_the_fingerprint():
    state = Host().state
    assert state.fingerprint(LABEL) == Fingerprint(model="toy@0", page_size=P, extra=f"kv/{LABEL}")
    assert state.lifecycle(LABEL).fingerprint.root == state.fingerprint(LABEL).root
