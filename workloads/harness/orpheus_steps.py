"""What one worker iteration runs for ``voice-mstar`` on M*'s ``Engine`` (``mstar_serving.Steps``): Orpheus's LLM node
generating audio codes and its SNAC decoder node turning them into audio.

Per iteration: the requests admitted since the last one prefill in one batch of the LLM's ``prefill`` walk; then one
batch of the ``decode`` walk for every other request still generating (all in-flight decode steps batched together);
each new token goes into its request's M* ``StreamBuffer`` under Orpheus's own chunk policy
(``SlidingWindowChunkPolicy`` from ``get_partition_topology``: 28 codes, stride 7; the rest flushed when the LLM is
done), and every request with a window ready gets one in a batch of the SNAC node's ``snac_chunk`` walk (repeated
while windows remain), whose ``audio_chunk`` is emitted. A request is done when its codes are all generated and its
buffer is drained.
"""

from __future__ import annotations

import torch

from workloads.harness.metrics import RequestResult


class OrpheusSteps:
    """``mstar_serving.Steps`` for a ``voice_mstar.VoiceMstar``; reuse on when ``cached``. ``sampled``: the CPU
    sampler's record (None on a GPU)."""

    def __init__(self, workload, cached: bool, sampled):
        from workloads.peers.mstar_orpheus import PrefixReuse, orpheus_engine

        made = workload.made
        self.workload, self.cached, self.sampled = workload, cached, sampled
        self.oe = orpheus_engine(made.weights, reuse=PrefixReuse(model=made.fingerprint) if cached else None,
                                 pages=workload.pool_pages, page_size=workload.page_size, cfg=workload.cfg,
                                 snac=made.snac)
        self.engine = self.oe.engine
        self.connection = oe_connection(workload)
        self.n_codes = workload.codes_per_request

    def start(self, lv) -> None:
        from mstar.streaming.stream_buffer import StreamBuffer

        from workloads.peers.mstar_orpheus import greedy

        c, rid = self.connection, lv.req.rid
        prompt = self.workload.prompt(lv.req)
        lv.state, lv.prompt_rows = _Request(prompt, StreamBuffer(rid, c.edge_name, c.from_partition,
                                                                 c.chunk_policy_factory())), len(prompt)
        self.engine.add_request(rid, greedy())

    def step(self, live: dict, clock) -> None:
        from workloads.peers.mstar_orpheus import engine_step

        new = {rid: lv for rid, lv in live.items() if not lv.state.prefilled}
        going = [lv for lv in live.values() if lv.state.prefilled and len(lv.tokens) < self.n_codes]
        if new:
            got = engine_step(self.oe, "prefill", {rid: lv.state.prompt for rid, lv in new.items()}, self.sampled)
            at = clock()
            for rid, (token, _) in got.items():
                self._add(new[rid], token, at)
                new[rid].computed, new[rid].state.prefilled = self.oe.fed[rid], True
        if going:
            got = engine_step(self.oe, "decode", {lv.req.rid: [lv.tokens[-1]] for lv in going}, self.sampled)
            at = clock()
            for rid, (token, _) in got.items():
                self._add(live[rid], token, at)
        self._decode_audio(live, clock)

    def done(self, lv) -> bool:
        return len(lv.tokens) == self.n_codes and not lv.state.buffer.has_chunk_ready()

    def finish(self, lv) -> RequestResult:
        self.engine.remove_request(lv.req.rid)
        self.workload.outputs[lv.req.rid], self.workload.audio[lv.req.rid] = lv.tokens, lv.state.audio
        P, n = self.workload.page_size, lv.prompt_rows
        return RequestResult(prompt_tokens=n, hit_tokens=n - lv.computed, prompt_pages=n // P,
                             hit_pages=(n - lv.computed) // P, output_tokens=len(lv.tokens))

    def stats(self) -> dict:
        from workloads.peers.mstar_orpheus import LABEL

        return {"prefix": self.oe.kv.stats(LABEL).to_dict()} if self.cached else {}

    def _add(self, lv, token: int, at: float) -> None:
        lv.add(token, at)
        buffer = lv.state.buffer
        buffer.pre_read_register(str(len(lv.tokens)))
        buffer.put(str(len(lv.tokens)), torch.tensor([token]))
        if len(lv.tokens) == self.n_codes:
            buffer.signal_done()

    def _decode_audio(self, live: dict, clock) -> None:
        """Every request with a window ready gets one, in a batch of the SNAC node, until no window is ready; an empty
        final chunk (the buffer's end marker) carries no codes and is not decoded."""
        from workloads.peers.mstar_engine import run_batch
        from workloads.peers.mstar_orpheus import SNAC_NODE

        while True:
            ready = {}
            for rid, lv in live.items():
                if lv.state.buffer.has_chunk_ready():
                    chunk = lv.state.buffer.pop_chunk()
                    if chunk.data["data"] is not None:
                        ready[rid] = {"new_token": [chunk.data["data"]]}
            if not ready:
                return
            b = run_batch(self.engine, SNAC_NODE, "snac_chunk", ready, {})
            at = clock()
            for rid in b.request_ids:
                lv = live[rid]
                lv.state.audio.append(b.outputs[rid]["audio_chunk"][0])
                lv.audio_s.append(at - lv.start)


class _Request:
    """What the steps keep for one request: its prompt, its stream buffer to the decoder, its audio chunks."""

    def __init__(self, prompt: list[int], buffer):
        self.prompt, self.buffer, self.prefilled = prompt, buffer, False
        self.audio: list[torch.Tensor] = []


def oe_connection(workload):
    """Orpheus's LLM -> SNAC streaming connection, as its model declares it (``get_partition_topology``)."""
    from workloads.peers.mstar_orpheus import orpheus_model

    made = workload.made
    (connection,) = orpheus_model(made.weights, workload.cfg, made.snac).get_partition_topology().connections
    return connection
