"""What one worker iteration runs for ``vlm-mstar`` on M*'s ``Engine`` (``mstar_serving.Steps``): Qwen3-Omni's vision
encoder node and thinker node, text output only.

At admission a request's images are decoded and preprocessed as M*'s data worker does
(``mstar_qwen3_omni.image_tensors``: ``pixel_values`` and the grid ``image_grid_thw``); with the cache on each also
gets its digest (``digests.image`` of the bytes as sent and the image processor, as ``media_digests.install_digests``
adds it), which travels to the vision encoder node as ``image_digest`` (as ``route_digests`` routes it, and only there:
M* 0.2.1 hands the thinker the encoder's outputs, not the digest).

Per iteration, every prefilling request runs its next walk of its schedule (``vlm_mstar``'s layout): all text walks
in one batch of the thinker's ``prefill_text`` (M*'s ``forward_batched``); each image alone (M*'s eager
``prefill_vision`` takes one request a step): one batch of the vision encoder node, whose ``vision_embeds`` and
``deepstack`` go with the grid to one batch of the thinker's ``prefill_vision``; then one batch of ``thinker_decode``
for every request that had its first token before this iteration. Every thinker step carries the conductor's
per-request metadata: ``is_prefill``, ``is_last_prefill`` (the walk that samples the first token) and
``audio_output = False`` (text output: the thinker streams no rows to a talker, so reuse may cut its walks). A walk
whose admit fails (no page for it) runs again next iteration, as M*'s worker retries it.
"""

from __future__ import annotations

import torch

from workloads.harness.metrics import RequestResult


class _Request:
    """One request's prefill schedule (walk, the thinker's or the encoder's inputs) and how far it has run."""

    def __init__(self, schedule: list, images: int):
        self.schedule, self.at, self.images, self.encoder_hits = schedule, 0, images, 0

    @property
    def walk(self) -> str | None:
        return self.schedule[self.at][0] if self.at < len(self.schedule) else None


class ThinkerSteps:
    """``mstar_serving.Steps`` for a ``vlm_mstar.VlmMstar``; reuse on (KV pages and encoder outputs) when
    ``cached``."""

    def __init__(self, workload, cached: bool, sampled):
        from mmcache.mstar.qwen3_omni import qwen3_omni_reuse
        from workloads.peers import mstar_qwen3_omni as q

        made = workload.made
        self.q, self.workload, self.cached, self.n = q, workload, cached, workload.max_new_tokens
        self.te = q.thinker_engine(made.weights, qwen3_omni_reuse(made.fingerprint) if cached else None,
                                   pages=workload.pool_pages, page_size=workload.page_size, vision=made.vision,
                                   encoder_bytes=workload.encoder_bytes)
        self.engine = self.te.engine
        self.model, self.processor = q.omni_model(made.weights), q.image_processor()  # the data worker's

    def start(self, lv) -> None:
        from digests.media import media_bytes

        q, schedule, rows = self.q, [], 0
        for kind, x in self.workload.walks(lv.req):
            if kind == self.workload.TEXT:
                schedule.append((q.TEXT, torch.tensor(x, dtype=torch.long)))
                rows += len(x)
                continue
            data = media_bytes(x, "image")
            pixels, grid = q.image_tensors(self.model, self.processor, data)
            inputs = {"pixel_values": [pixels], "image_grid_thw": [grid], **(self._digest(data) if self.cached else {})}
            schedule.append((q.VISION, inputs))
            rows += int(grid.prod()) // 4 + 2  # one row per merged 2 x 2 patch, and the two sentinels
        lv.state, lv.prompt_rows = _Request(schedule, sum(w == q.VISION for w, _ in schedule)), rows
        self.engine.add_request(lv.req.rid, q.greedy())

    def _digest(self, data: bytes) -> dict:
        """``image_digest`` as M*'s data worker carries it with ``install_digests`` (no tenant salt)."""
        import digests
        from mmcache.mstar.media_digests import carried, digest_tensors

        return digest_tensors(carried({"image": [digests.image(data, self.processor)]}, b""))

    def step(self, live: dict, clock) -> None:
        q = self.q
        prefilling = [lv for lv in live.values() if lv.state.walk is not None]
        going = [lv for lv in live.values() if lv.state.walk is None and len(lv.tokens) < self.n]
        texts = [lv for lv in prefilling if lv.state.walk == q.TEXT]
        if texts:
            self._thinker(q.TEXT, {lv.req.rid: {"text_inputs": [lv.state.schedule[lv.state.at][1]]} for lv in texts},
                          live, clock)
        for lv in prefilling:
            if lv.state.walk == q.VISION:
                self._image(lv, live, clock)
        if going:
            self._thinker(q.DECODE, {lv.req.rid: {"text_inputs": [torch.tensor([lv.tokens[-1]])]} for lv in going},
                          live, clock)

    def _image(self, lv, live: dict, clock) -> None:
        """One image: the vision encoder node, then the thinker's vision walk on its outputs and grid."""
        q, rid, inputs = self.q, lv.req.rid, lv.state.schedule[lv.state.at][1]
        hits = self.te.vision.counters.hits if self.cached else 0
        encoded = q.run_batch(self.engine, q.VISION_NODE, q.VISION, {rid: inputs}, q.greedy()).outputs[rid]
        lv.state.encoder_hits += (self.te.vision.counters.hits - hits) if self.cached else 0
        item = (encoded["vision_embeds"][0], encoded["deepstack"], inputs["image_grid_thw"][0])
        self._thinker(q.VISION, {rid: q.walk_inputs(q.VISION, item)}, live, clock)

    def _thinker(self, walk: str, feeds: dict, live: dict, clock) -> None:
        """One batch of the thinker on ``walk``; each request's token (its first at its last prefill walk, then
        each decode) stamped when the batch returns."""
        q = self.q
        prefill = walk != q.DECODE
        meta = {rid: {"is_prefill": prefill, "audio_output": False, "is_last_prefill": prefill and
                      live[rid].state.at == len(live[rid].state.schedule) - 1} for rid in feeds}
        b = q.run_batch(self.engine, q.THINKER, walk, feeds, q.greedy(), metadata_of=meta)
        if b.admit_error is not None:  # nothing ran: the same walk runs again next iteration
            return
        at = clock()
        for rid, fed in zip(b.request_ids, b.inputs, strict=True):
            lv = live[rid]
            if prefill:
                lv.computed += int(fed.input_seq_len)
                lv.state.at += 1
            token = (b.outputs.get(rid) or {}).get("new_token")
            if token is not None and (not prefill or lv.state.walk is None):
                lv.add(int(token[0].reshape(-1)[0]), at)

    def done(self, lv) -> bool:
        return len(lv.tokens) == self.n

    def finish(self, lv) -> RequestResult:
        self.engine.remove_request(lv.req.rid)
        self.workload.outputs[lv.req.rid] = lv.tokens
        P, n, hit = self.workload.page_size, lv.prompt_rows, lv.prompt_rows - lv.computed
        return RequestResult(prompt_tokens=n, hit_tokens=hit, prompt_pages=n // P, hit_pages=hit // P,
                             output_tokens=len(lv.tokens), encoder_items={"image": lv.state.images},
                             encoder_hits={"image": lv.state.encoder_hits})

    def stats(self) -> dict:
        if not self.cached:
            return {}
        return {"prefix": self.te.kv.stats(self.q.LABEL).to_dict(), "encoder": self.te.vision.store.stats().to_dict()}
