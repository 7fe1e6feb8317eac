"""PagedAllocator under a hypothesis state machine: two labels, batches, offload/reload, windows and index clears,
checked against a model of the KV every position must hold."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmcache.errors import AllocationFailed, InvalidRequest
from conftest import (ALLOC_P as P, ALLOC_LABELS as LABELS, alloc_make as make, alloc_hosts as hosts,
                      alloc_sequence as sequence, alloc_values as values, alloc_write as write,
                      alloc_assert_exact as assert_exact, alloc_snapshot as snapshot)


# ---------------------------------------------------------------------------------------------------- stateful
STEMS = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [2, 2, 1, 1, 0, 0, 2, 2, 1, 1], [1] * 10]
PROMPTS = st.builds(lambda stem, cut, tail: stem[:cut] + tail or [0], st.sampled_from(STEMS), st.integers(0, 10),
                    st.lists(st.integers(0, 2), max_size=4))
PAGES, HOST_PAGES = {"text": 10, "audio": 7}, 3


class EngineMachine(RuleBasedStateMachine):
    """An engine over two labels: requests come and go, in batches or not, offloaded, reloaded and windowed, while
    another thread of control clears an index now and then."""

    def __init__(self):
        super().__init__()
        self.alloc = make(PAGES["text"], PAGES["audio"], evict=2)
        self.host = hosts(self.alloc, HOST_PAGES)
        self.reqs: dict[int, dict] = {}
        self.batches: dict[int, list[int]] = {}
        self.next_id = 0

    # ---- model helpers
    def expected(self, rid, label, upto):
        r = self.reqs[rid]
        return values(label, r["salt"], r["prompts"].get(label), upto, rid=rid)

    def admitted(self, rid):
        r = self.reqs[rid]
        return [label for label in LABELS if label in r["prompts"] or label in r["allocated"]]

    def held_by_live(self, label):
        return {p for rid in self.reqs for p in self.alloc.get_state(rid, label).page_indices}

    def in_batch(self, rid):
        return any(rid in rids for rids in self.batches.values())

    def pick(self, data, ok=lambda r: True):
        rids = sorted(rid for rid, r in self.reqs.items() if ok(r))
        return data.draw(st.sampled_from(rids)) if rids else None

    # ---- rules
    @precondition(lambda self: len(self.reqs) < 4)
    @rule(text=PROMPTS, audio=st.none() | PROMPTS, salt=st.sampled_from([b"", b"tenant"]),
          windowed=st.sampled_from([False, False, True]))
    def add(self, text, audio, salt, windowed):
        rid, self.next_id = self.next_id, self.next_id + 1
        prompts = {"text": text} if audio is None else {"text": text, "audio": audio}
        states = self.alloc.add_request(rid, LABELS, token_ids=prompts, salt=salt)
        self.reqs[rid] = {"prompts": prompts, "salt": salt, "offloaded": False, "removing": False,
                          "allocated": {}, "windowed": windowed}
        for label, state in states.items():
            assert state.matched_tokens <= max(0, (len(prompts.get(label, [0])) - 1)) // P * P

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(text=PROMPTS, audio=PROMPTS, decode=st.integers(0, 6))
    def serve(self, text, audio, decode):
        """A whole request in one step, so that the indexes fill and later requests hit and evict."""
        rid = self.next_id
        self.add(text, audio, b"", False)
        outputs = {}
        for label, prompt in self.reqs[rid]["prompts"].items():
            total = len(prompt) + decode
            try:
                self.alloc.alloc(rid, label, total)
            except AllocationFailed:
                self.alloc.abort_request(rid)
                del self.reqs[rid]
                return
            write(self.alloc, rid, label, total, self.expected(rid, label, total))
            outputs[label] = sequence(prompt, total)[len(prompt):]
        self.alloc.remove_request(rid, output_ids=outputs)
        del self.reqs[rid]

    @rule(data=st.data(), label=st.sampled_from(LABELS), extra=st.integers(0, 10),
          fill=st.sampled_from([False, False, False, True]))
    def alloc_pages(self, data, label, extra, fill):
        """Grow by ``extra`` tokens, or (``fill``) to exactly every page no live request holds: that must succeed."""
        rid = self.pick(data, lambda r: not r["offloaded"])
        if rid is None:
            return
        before, held = self.alloc.get_state(rid, label), self.held_by_live(label)
        spanned = before.position_id_start // P + len(before.page_indices) + before.released_tokens // P
        total = (spanned + PAGES[label] - len(held)) * P if fill else before.seq_len + extra
        try:
            self.alloc.alloc(rid, label, total)
        except AllocationFailed as err:
            assert (err.request_id, err.label) == (rid, label) and err.pages_short > 0
            assert -(-total // P) - spanned > PAGES[label] - len(held), "refused because of cached data"
            assert self.alloc.get_state(rid, label) == before
            return
        self.reqs[rid]["allocated"][label] = True

    @rule(data=st.data(), label=st.sampled_from(LABELS), k=st.integers(1, 9))
    def write_kv(self, data, label, k):
        rid = self.pick(data, lambda r: not r["offloaded"])
        if rid is None or label not in self.admitted(rid):
            return
        state = self.alloc.get_state(rid, label)
        upto = min(state.seq_len, state.computed_tokens + k)
        write(self.alloc, rid, label, upto, self.expected(rid, label, upto))

    @rule(data=st.data(), abort=st.booleans())
    def remove(self, data, abort):
        rid = self.pick(data)
        if rid is None:
            return
        r = self.reqs[rid]
        if r["removing"]:
            with pytest.raises(InvalidRequest):
                self.alloc.remove_request(rid)
            return
        outputs = {}
        for label, prompt in r["prompts"].items():
            upto = self.alloc.get_state(rid, label).seq_len
            outputs[label] = sequence(prompt, upto)[len(prompt):]
        before = snapshot(self.alloc, [rid])
        now = self.alloc.abort_request(rid) if abort else self.alloc.remove_request(rid, output_ids=outputs)
        assert now == (not self.in_batch(rid))
        if now:
            del self.reqs[rid]
        else:
            assert snapshot(self.alloc, [rid]) == before, "a queued removal changed pages"
            r["removing"] = True

    @rule(data=st.data())
    def begin(self, data):
        rids = sorted(rid for rid, r in self.reqs.items() if not r["offloaded"] and not r["removing"])
        if not rids:
            return
        chosen = data.draw(st.lists(st.sampled_from(rids), min_size=1, unique=True))
        self.batches[self.alloc.begin_batch(chosen)] = chosen

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def complete(self, data):
        batch_id = data.draw(st.sampled_from(sorted(self.batches)))
        rids = self.batches.pop(batch_id)
        due = [rid for rid in rids if self.reqs[rid]["removing"] and not self.in_batch(rid)]
        assert self.alloc.complete_batch(batch_id) == due
        for rid in due:
            del self.reqs[rid]

    @rule(data=st.data())
    def offload(self, data):
        rid = self.pick(data, lambda r: not r["offloaded"])
        if rid is None:
            return
        labels = self.admitted(rid)
        states = {label: self.alloc.get_state(rid, label) for label in labels}
        windowed = any(s.protected_tokens is not None for s in states.values())
        before = snapshot(self.alloc, [rid])
        if windowed or self.in_batch(rid):
            with pytest.raises(InvalidRequest):
                self.alloc.offload_request(rid, self.host)
            assert snapshot(self.alloc, [rid]) == before
            return
        counts = {label: self.alloc.cache(label).pool.counts.copy() for label in labels}
        try:
            freed = self.alloc.offload_request(rid, self.host)
        except AllocationFailed as err:                                  # the host pool is full
            assert self.host[err.label].num_free < (counts[err.label][list(states[err.label].page_indices)]
                                                    == 1).sum()
            assert snapshot(self.alloc, [rid]) == before
            return
        own = 0
        for label, state in states.items():
            pool, pages = self.alloc.cache(label).pool, list(state.page_indices)
            shared = [p for p in pages if counts[label][p] > 1]
            assert (pool.counts[shared] == counts[label][shared] - 1).all(), "shared pages stay resident"
            own += len(pages) - len(shared)
        assert freed == own
        self.reqs[rid]["offloaded"] = True

    @precondition(lambda self: any(r["offloaded"] for r in self.reqs.values()))
    @rule(data=st.data())
    def reload(self, data):
        rid = self.pick(data, lambda r: r["offloaded"])
        if rid is None:
            return
        records = self.alloc._requests[rid].offloaded
        need = {label: off.first_page + off.pages for label, off in records.items()}
        try:
            back = self.alloc.reload_request(rid, self.host)
        except AllocationFailed as err:
            assert need[err.label] > PAGES[err.label] - len(self.held_by_live(err.label))
            assert self.alloc.is_offloaded(rid)
            return
        for label, got in back.items():
            assert got.restored_pages + got.discarded_pages == records[label].pages
        self.reqs[rid]["offloaded"] = False

    @rule(data=st.data(), label=st.sampled_from(LABELS), release=st.integers(0, 3))
    def slide_window(self, data, label, release):
        rid = self.pick(data, lambda r: r["windowed"] and not r["offloaded"])
        if rid is None or label not in self.admitted(rid):
            return
        protect = data.draw(st.integers(0, self.alloc.get_state(rid, label).seq_len))
        try:
            self.alloc.protect_prefix(rid, label, protect)
            self.alloc.release_oldest(rid, label, release)
        except InvalidRequest:
            pass

    @rule(label=st.sampled_from(LABELS))
    def clear_index(self, label):
        self.alloc.cache(label).clear()

    # ---- invariants
    @invariant()
    def owner_counts_equal_holders(self):
        for label in LABELS:
            cache = self.alloc.cache(label)
            holders = np.zeros(PAGES[label], dtype=np.int32)
            for rid in self.reqs:
                np.add.at(holders, list(self.alloc.get_state(rid, label).page_indices), 1)
            holders += cache.index.indexed
            assert (cache.pool.counts == holders).all()
            assert sorted(cache.pool._free) == np.flatnonzero(cache.pool.counts == 0).tolist()
        for label, host in self.host.items():
            offloaded = sum(len(e.offloaded[label].host_pages) for e in self.alloc._requests.values()
                            if e.offloaded and label in e.offloaded)
            assert host.num_pages - host.num_free == offloaded

    @invariant()
    def every_held_position_holds_its_own_kv(self):
        for rid, r in self.reqs.items():
            if r["offloaded"]:
                continue
            for label in self.admitted(rid):
                upto = self.alloc.get_state(rid, label).computed_tokens
                assert_exact(self.alloc, rid, label, self.expected(rid, label, upto))

    def teardown(self):
        for batch_id in list(self.batches):
            self.alloc.complete_batch(batch_id)
        for rid in list(self.alloc._requests):
            self.alloc.remove_request(rid)
        assert len(self.alloc) == 0
        for label in LABELS:
            self.alloc.cache(label).clear()
            assert self.alloc.cache(label).pool.num_free == PAGES[label], "pages leaked"
            assert self.host[label].num_free == HOST_PAGES, "host pages leaked"


TestEngineAllocatorStateful = EngineMachine.TestCase
