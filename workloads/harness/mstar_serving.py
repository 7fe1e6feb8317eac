"""Serve an Orpheus-shaped TTS workload (``voice-mstar``) through M*'s real ``Engine`` with up to ``in_flight`` requests
at once, its LLM node generating audio codes and its SNAC decoder node turning them into audio, cache off then on,
and measure what users would see: nothing here is simulated.

Engine: one M* ``Engine`` (mstar-ai 0.2.1) holding both of Orpheus's nodes (``workloads.peers.mstar_orpheus``). Cache
off: M*'s own ``KVSpec`` (``KVManager``: it computes every prompt token). Cache on: the same model after
``enable_reuse`` (``ReuseKVManager`` over mmcache's pool). Both hold the workload's ``pool_pages`` KV pages of
``page_size`` tokens. On a CPU machine M*'s flashinfer and triton kernels are torch stand-ins
(``workloads.peers.mstar_cpu_kernels``); nothing else is.

One loop, as M*'s worker drives the engine, one iteration a step: admit what may start (``admission.Admission``: in-
flight slots, sessions, arrivals) and prefill those requests in one batch of the LLM's ``prefill`` walk; then one batch
of the ``decode`` walk for every other request still generating (all in-flight decode steps batched together); each new
token goes into its request's M* ``StreamBuffer`` under Orpheus's own chunk policy (``SlidingWindowChunkPolicy`` from
``get_partition_topology``: 28 codes, stride 7; the rest flushed when the LLM is done), and every request with a window
ready gets one in a batch of the SNAC node's ``snac_chunk`` walk (repeated while windows remain), whose ``audio_chunk``
is emitted. A request ends when its codes are all generated and its buffer is drained; then ``remove_request``. Every
request generates exactly the workload's codes (greedy, no stop at end of speech), so under ``closed:N`` both runs make
the same batches step for step.

Timeline (seconds since the replay started, wall clock): a request arrives at its schedule's time (trace and poisson
arrivals are waited for in real time; under ``closed:C`` a request arrives when it is sent), starts when admitted
(``add_request``), its tokens are stamped when the step that sampled them returns and its audio chunks when the SNAC
batch that decoded them returns. TTFT = queueing + the prefill under the load of the others; TTFA = queueing + the
first audio chunk the decoder emits (at the earliest 28 codes in); ITL = gaps between token stamps.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from workloads.harness.admission import Admission
from workloads.harness.engine_serving import compare_engine, engine_label, record_done
from workloads.harness.metrics import RequestRecord, RequestResult, RunResult
from workloads.harness.progress import progress_bar
from workloads.harness.serving import Observer, Schedule

ENGINE = "M*'s Engine (mstar-ai 0.2.1: Orpheus LLM + SNAC decoder nodes)"


class _Live:
    """One request in flight: its prompt, what it generated, its stamps and its stream buffer to the decoder."""

    def __init__(self, req, k: int, arrival: float | None, start: float, prompt: list[int], buffer):
        self.req, self.k, self.arrival, self.start, self.prompt, self.buffer = req, k, arrival, start, prompt, buffer
        self.codes: list[int] = []
        self.token_s: list[float] = []
        self.audio_s: list[float] = []
        self.audio: list[torch.Tensor] = []
        self.fed = 0  # prompt tokens the prefill computed

    def add(self, token: int, at: float, done: bool) -> None:
        self.codes.append(token)
        self.token_s.append(at - self.start)
        self.buffer.pre_read_register(str(len(self.codes)))
        self.buffer.put(str(len(self.codes)), torch.tensor([token]))
        if done:
            self.buffer.signal_done()


def serve_mstar_run(workload, schedule: Schedule, cached: bool, in_flight: int, *, observer: Observer | None = None,
                    progress: bool = False) -> RunResult:
    """Serve every request of ``workload`` (a ``voice_mstar.VoiceMstar``) through M*'s engine, reuse on when
    ``cached``, at most ``in_flight`` at once (``closed:C``: at most ``min(C, in_flight)``); ``workload.outputs`` gets
    each request's codes, ``workload.audio`` its audio chunks."""
    from workloads.peers import mstar_cpu_kernels

    order, arrivals = schedule.plan(list(workload.requests()))
    limit = min(in_flight, schedule.concurrency or in_flight)
    run = RunResult(workload.name, cached, engine_label(schedule, limit, ENGINE), dict(workload.ceilings()),
                    planned=len(order))
    if observer is not None:
        observer.start(run)
    bar = progress_bar(len(order), f"{workload.name}, cache {run.label}, {limit} in flight", enabled=progress)
    cpu = not torch.cuda.is_available()
    with _quiet_mstar(), mstar_cpu_kernels.installed() if cpu else contextlib.nullcontext() as sampled:
        oe = _engine(workload, cached)
        started = time.perf_counter()
        _loop(workload, oe, sampled, order, arrivals, limit, run, observer, bar)
        run.wall_s = time.perf_counter() - started
        run.cache_stats = _stats(oe, cached)
        oe.engine.shutdown()
    bar.close()
    return run


def _engine(workload, cached: bool):
    from workloads.peers.mstar_orpheus import PrefixReuse, orpheus_engine

    made = workload.made
    reuse = PrefixReuse(model=made.fingerprint) if cached else None
    return orpheus_engine(made.weights, reuse=reuse, pages=workload.pool_pages, page_size=workload.page_size,
                          cfg=workload.cfg, snac=made.snac)


def _stats(oe, cached: bool) -> dict:
    from workloads.peers.mstar_orpheus import LABEL

    return {"prefix": oe.kv.stats(LABEL).to_dict()} if cached else {}


def _loop(workload, oe, sampled, order, arrivals, limit: int, run: RunResult, observer, bar) -> None:
    from mstar.streaming.stream_buffer import StreamBuffer

    from workloads.peers.mstar_orpheus import SNAC_NODE, engine_step, greedy, run_batch

    connection = oe_connection(workload)
    admission = Admission([r.session for r in order], arrivals, limit)
    live: dict[str, _Live] = {}
    n_codes, P = workload.codes_per_request, workload.page_size
    t0 = time.perf_counter()
    while admission or live:
        now = time.perf_counter() - t0
        new = {}
        for k in admission.take(now):
            req = order[k]
            buffer = StreamBuffer(req.rid, connection.edge_name, connection.from_partition,
                                  connection.chunk_policy_factory())
            new[req.rid] = live[req.rid] = _Live(req, k, None if arrivals is None else arrivals[k], now,
                                                 workload.prompt(req), buffer)
            oe.engine.add_request(req.rid, greedy())
        if not live:
            time.sleep(admission.wait_s(time.perf_counter() - t0) or 1e-3)
            continue
        going = [lv for lv in live.values() if lv.codes and len(lv.codes) < n_codes]
        if new:
            got = engine_step(oe, "prefill", {rid: lv.prompt for rid, lv in new.items()}, sampled)
            at = time.perf_counter() - t0
            for rid, (token, _) in got.items():
                new[rid].add(token, at, n_codes == 1)
                new[rid].fed = oe.fed[rid]
        if going:
            got = engine_step(oe, "decode", {lv.req.rid: [lv.codes[-1]] for lv in going}, sampled)
            at = time.perf_counter() - t0
            for rid, (token, _) in got.items():
                live[rid].add(token, at, len(live[rid].codes) + 1 == n_codes)
        _decode_audio(oe, live, run_batch, SNAC_NODE, t0)
        for rid in [rid for rid, lv in live.items() if len(lv.codes) == n_codes and not lv.buffer.has_chunk_ready()]:
            lv = live.pop(rid)
            oe.engine.remove_request(rid)
            admission.finished(lv.k)
            workload.outputs[rid], workload.audio[rid] = lv.codes, lv.audio
            result = RequestResult(prompt_tokens=len(lv.prompt), hit_tokens=len(lv.prompt) - lv.fed,
                                   prompt_pages=len(lv.prompt) // P, hit_pages=(len(lv.prompt) - lv.fed) // P,
                                   output_tokens=len(lv.codes))
            end = max(lv.token_s[-1], lv.audio_s[-1] if lv.audio_s else 0.0)
            rec = RequestRecord(rid, lv.req.session, lv.start if lv.arrival is None else lv.arrival, lv.start, end,
                                result, token_s=tuple(lv.token_s), audio_s=tuple(lv.audio_s))
            record_done(run, rec, _stats(oe, run.cached), observer, bar)


def oe_connection(workload):
    """Orpheus's LLM -> SNAC streaming connection, as its model declares it (``get_partition_topology``)."""
    from workloads.peers.mstar_orpheus import orpheus_model

    made = workload.made
    (connection,) = orpheus_model(made.weights, workload.cfg, made.snac).get_partition_topology().connections
    return connection


def _decode_audio(oe, live: dict, run_batch, node: str, t0: float) -> None:
    """Every request with a window ready gets one, in a batch of the SNAC node, until no window is ready; an empty
    final chunk (the buffer's end marker) carries no codes and is not decoded."""
    while True:
        ready = {}
        for rid, lv in live.items():
            if lv.buffer.has_chunk_ready():
                chunk = lv.buffer.pop_chunk()
                if chunk.data["data"] is not None:
                    ready[rid] = {"new_token": [chunk.data["data"]]}
        if not ready:
            return
        b = run_batch(oe.engine, node, "snac_chunk", ready, {})
        at = time.perf_counter() - t0
        for rid in b.request_ids:
            lv = live[rid]
            lv.audio.append(b.outputs[rid]["audio_chunk"][0])
            lv.audio_s.append(at - lv.start)


@contextlib.contextmanager
def _quiet_mstar():
    """M*'s loggers at ERROR while it runs: its hub lookup of a local folder and "no CUDA, no graph capture" warn."""
    logger = logging.getLogger("mstar")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def warm(workload) -> None:
    """The first request that starts a session, alone through a throwaway engine with reuse on (so both paths'
    first calls are paid), so first-call costs land on neither measured run."""
    import dataclasses

    first = next(r for r in workload.requests() if not r.payload.history)
    serve_mstar_run(dataclasses.replace(workload.made, requests=(first,))(), Schedule(), True, 1)


def compare_mstar(workload_factory, schedule: Schedule, in_flight: int, *, observer: Observer | None = None,
                  progress: bool = False) -> tuple[RunResult, RunResult, int]:
    """``(off, on, equal)`` through M*'s engine (``engine_serving.compare_engine`` with this replay): ``equal``
    counts the requests whose generated codes are the same with reuse off and on."""
    return compare_engine(workload_factory, schedule, in_flight, observer=observer, progress=progress,
                          serve=serve_mstar_run, warm_up=warm)
