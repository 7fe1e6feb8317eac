"""``image-gen``: text-to-image requests through a Wan diffusers pipeline, its umT5 prompt encoder cached.

Requests: DiffusionDB prompts in their original order (``diffusiondb/diffusiondb_5k.jsonl`` under the data folder,
field ``prompt``; users re-prompt iteratively and ~13% of requests repeat an earlier prompt exactly), or without data
a generated default with the same structure (``generate_prompts``). Every request also carries the same classifier-
free-guidance negative prompt (``NEGATIVE_PROMPT``, Wan's default) and its own seed (``options.seed`` + its index).

Serving one request: ``stage("text")`` encodes the prompt and the negative prompt, ``stage("denoise")`` runs the
pipeline on the embeddings (denoising and VAE decode; 2 steps, a 16x16 single frame, ``guidance_scale`` 5, so
CFG runs the negative branch), and ``clock.token()`` marks the finished image: for this workload **TTFT is the time
to the output image** (queueing included). Cache off: ``pipe.encode_prompt`` runs the text encoder on both prompts.
Cache on: a ``CachedPromptEncoder`` over an ``EncoderStore`` (modality ``"text"``): the negative prompt hits from the
second request on, repeated prompts hit, and the embeddings go to the pipeline as ``prompt_embeds`` /
``negative_prompt_embeds``. Invariant: the output with the store on equals the output with it off bit for bit
(both runs see the same seeds; ``outputs`` holds a 128-bit digest of each image's bytes to check it).

Arrivals: these prompts carry no timestamps, so every request arrives at 0 and the ``trace`` schedule is a backlog in
the original order (throughput = capacity, TTFT = queueing + service); ``closed:1`` gives per-request latency without
queueing. Each request is its own session (DiffusionDB's user ids are not in the file); generated ones are grouped by
their simulated user.

Models: ``options.model`` is a local folder of a Wan 2.x text-to-video pipeline (``WanPipeline.from_pretrained``);
without it the tiny Wan pipeline of ``workloads.fixtures`` (``tiny_wan``). The pipeline runs on CUDA when available,
else on the CPU.

Bad data: a missing file or a line that is not a JSON object with a string ``prompt`` raises ``TraceError`` naming
the file and line while loading, before anything is served; blank lines are skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import xxhash

from mmcache.encoder_store import EncoderStore
from workloads import fixtures
from workloads.harness.metrics import RequestResult
from workloads.harness.serving import Clock, Request
from workloads.options import ModelWorkloadOptions
from workloads.traces.diffusiondb import load_prompts

DIFFUSIONDB = Path("diffusiondb") / "diffusiondb_5k.jsonl"
DEFAULT_REQUESTS = 200  # generated requests when neither data nor a limit is given
MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default: every prompt is padded to 512 tokens
ENCODER_PAGE_BYTES = 4096
NEGATIVE_PROMPT = ("Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, "
                   "static, overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, "
                   "extra fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, "
                   "fused fingers, still picture, messy background, three legs, many people in the background, "
                   "walking backwards")  # Wan 2.1's default negative prompt, as diffusers' examples translate it
CALL = dict(height=16, width=16, num_frames=1, num_inference_steps=2, guidance_scale=5.0, output_type="pt",
            max_sequence_length=MAX_SEQUENCE_LENGTH)  # cheap denoising; guidance > 1 runs the negative branch

SUBJECTS = ("a lighthouse on a cliff", "a red fox in the snow", "an old library full of plants", "a robot gardener",
            "a floating island city", "a cat in a space suit", "a desert caravan at dusk", "a koi pond in the rain",
            "a steam train crossing a bridge", "a knight resting by a fire", "a village of giant mushrooms",
            "a night market with paper lanterns", "a whale swimming through clouds", "a cabin in a pine forest",
            "a dragon made of glass", "a field of sunflowers", "a submarine in a coral reef", "an owl reading a map")
STYLES = ("oil painting", "watercolor", "digital art", "pencil sketch", "3d render", "photograph", "woodblock print",
          "pixel art", "concept art", "low poly", "charcoal drawing", "stained glass")
DETAILS = ("highly detailed", "soft lighting", "dramatic shadows", "golden hour", "sharp focus", "volumetric fog",
           "pastel colors", "wide angle", "4k", "cinematic", "intricate", "muted tones", "vivid colors",
           "symmetrical", "rim light", "film grain", "depth of field", "hyperrealistic")


@dataclasses.dataclass(frozen=True)
class Generation:
    """One text-to-image request: the user's prompt and the seed of its initial noise."""

    prompt: str
    seed: int


def generate_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` ``(user, prompt)`` pairs shaped like DiffusionDB, from the small vocabulary above.

    Each user starts from a subject, a style and 2-4 details, then re-prompts a geometric number of times (mean 3);
    each step re-runs the last prompt (13%), goes back to an earlier one of theirs (2%), or tweaks it (adds, drops or
    swaps a detail, or swaps the style). Over a few thousand requests that gives ~13% exact repeats, ~80% of them back
    to back (DiffusionDB's first 5,000: 13.7%, 86%); the same ``seed`` gives the same list."""
    rng = np.random.default_rng(seed)
    pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
    out: list[tuple[str, str]] = []
    for user in itertools.count():
        if len(out) >= n:
            break
        subject, style = pick(SUBJECTS), pick(STYLES)
        details = [str(d) for d in rng.choice(DETAILS, int(rng.integers(2, 5)), replace=False)]
        history = [f"{subject}, {style}, {', '.join(details)}"]
        for _ in range(int(rng.geometric(0.25)) - 1):
            u, unused = rng.random(), [d for d in DETAILS if d not in details]
            if u < 0.15:
                history.append(history[-1] if u < 0.13 else pick(history))
                continue
            tweak = int(rng.integers(4))
            if tweak == 0 and len(details) < 6:
                details.append(pick(unused))
            elif tweak == 1 and len(details) > 1:
                details.pop(int(rng.integers(len(details))))
            elif tweak == 2:
                details[int(rng.integers(len(details)))] = pick(unused)
            else:
                style = pick([s for s in STYLES if s != style])
            history.append(f"{subject}, {style}, {', '.join(details)}")
        out += [(f"u{user}", p) for p in history]
    return out[:n]


def prompt_encoder(pipe, store: EncoderStore | None, fingerprint: str | None = None):
    """The pipeline's umT5 prompt encoder through ``store`` (``encoders.text.CachedPromptEncoder``; None: keys only)
    at ``MAX_SEQUENCE_LENGTH``. Imported here, as every diffusers import in this module: importing the module (the
    command line does) stays cheap; diffusers' pipelines take seconds to import."""
    from encoders.text import CachedPromptEncoder

    return CachedPromptEncoder.from_pipeline(pipe, store, max_sequence_length=MAX_SEQUENCE_LENGTH,
                                             fingerprint=fingerprint)


class ImageGen:
    """One replay's worth of state: the shared pipeline, a fresh (empty) ``EncoderStore`` and the outputs so far.

    ``outputs[rid]`` is the xxh3-128 hex digest of request ``rid``'s image bytes (``output_type="pt"``, float32), so
    the cache-off and cache-on runs of one ``compare`` can be checked equal bit for bit without keeping images."""

    name = "image-gen"

    def __init__(self, pipe, requests: list[Request], fingerprint: str, ceiling: float, encoder_bytes: int):
        self.pipe, self._requests, self._ceiling = pipe, requests, ceiling
        self.store = EncoderStore(encoder_bytes, ENCODER_PAGE_BYTES, pipe._execution_device)
        self.encoder = prompt_encoder(pipe, self.store, fingerprint)
        self.outputs: dict[str, str] = {}

    def requests(self) -> list[Request]:
        return self._requests

    def embeds(self, prompt: str, cached: bool, clock: Clock) -> tuple[list[torch.Tensor], int]:
        """``([prompt_embeds, negative_prompt_embeds], text hits)`` of ``prompt`` and ``NEGATIVE_PROMPT`` inside
        ``stage("text")``: through the store when ``cached`` (hits: how many of the two it served), else the
        pipeline's own ``encode_prompt``."""
        with clock.stage("text"):
            if cached:
                found = [self.encoder.lookup(p) for p in (prompt, NEGATIVE_PROMPT)]
                return [self.encoder.pad(f.value) for f in found], sum(f.hit for f in found)
            with torch.no_grad():  # as WanPipeline.__call__ runs it
                return list(self.pipe.encode_prompt(prompt, NEGATIVE_PROMPT,
                                                    max_sequence_length=MAX_SEQUENCE_LENGTH)), 0

    def generate(self, gen: Generation, cached: bool, clock: Clock) -> tuple[torch.Tensor, int]:
        """``(frames, text hits)``: the output [1, frames, 3, H, W] of ``gen``, and how many of its two prompt
        encodes the store served (0 with the cache off)."""
        embeds, hits = self.embeds(gen.prompt, cached, clock)
        with clock.stage("denoise"):
            frames = self.pipe(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1],
                               generator=torch.Generator("cpu").manual_seed(gen.seed), **CALL).frames
        return frames, hits

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult:
        frames, hits = self.generate(req.payload, cached, clock)
        clock.token()  # the first (and only) output event: the finished image
        self.outputs[req.rid] = xxhash.xxh3_128(frames.detach().cpu().contiguous().numpy()).hexdigest()
        return RequestResult(output_tokens=1, encoder_items={"text": 2}, encoder_hits={"text": hits})

    def cache_stats(self) -> dict:
        return {"encoder": self.store.stats().to_dict()}

    def ceilings(self) -> dict[str, float]:
        """``text``: 1 - distinct prompt keys (the negative included) / prompt encodes (two per request), the rate an
        unbounded store realizes in any order. Keys are taken after cleaning and tokenizing, so with the tiny
        pipeline's lossless tokenizer they are the distinct prompt strings up to whitespace."""
        return {"text": self._ceiling}

    def ceiling_weights(self) -> dict[str, int]:
        """What each ceiling is a share of (prompt encodes), so a blend of workloads can weigh them."""
        return {"text": 2 * len(self._requests)}


def prompt_rows(options: ModelWorkloadOptions, default: int = DEFAULT_REQUESTS) -> list[tuple[str | None, str]]:
    """``(user or None, prompt)`` rows: DiffusionDB prompts in order from ``options.data`` (the data folder, or the
    JSONL file itself), else ``default`` generated ones; at most ``options.limit``."""
    if options.data is None:
        return generate_prompts(default if options.limit is None else options.limit, options.seed)
    path = Path(options.data)
    path = path if path.is_file() else path / DIFFUSIONDB
    return [(None, p) for p in load_prompts(path, options.limit)]


def _requests(options: ModelWorkloadOptions) -> list[Request]:
    rows = prompt_rows(options)
    return [Request(f"r{k}", user or f"r{k}", 0.0, Generation(prompt, options.seed + k))
            for k, (user, prompt) in enumerate(rows)]


def factory(options: ModelWorkloadOptions) -> Callable[[], ImageGen]:
    """Load the requests and the pipeline once, fingerprint the text encoder once, compute the ceiling, and warm
    both serving paths up (first-call costs would land on the cache-off run); each call of the result is a fresh
    ``ImageGen`` whose store is empty."""
    requests = _requests(options)
    pipe = fixtures.load_wan(options)
    keys = prompt_encoder(pipe, None)
    distinct = {keys.key(NEGATIVE_PROMPT), *(keys.key(r.payload.prompt) for r in requests)}
    ceiling = 1 - len(distinct) / (2 * len(requests)) if requests else 0.0
    make = lambda: ImageGen(pipe, requests, keys.fingerprint, ceiling, options.encoder_bytes)  # noqa: E731
    warm = make()
    for cached in (False, True, True):  # uncached, a miss, a hit
        warm.generate(Generation("a warm-up prompt", 0), cached, Clock())
    return make


def main(argv: list[str] | None = None) -> None:
    """``python -m workloads.models.image_gen [--data PATH] [--limit N] [--schedule trace] [--slo-ms MS]
    [--threads N]``: the cache off, then on, and their summary table."""
    import argparse

    from workloads.harness.metrics import SLO, stage_seconds, summary_table
    from workloads.harness.serving import Schedule, compare

    ap = argparse.ArgumentParser(prog="python -m workloads.models.image_gen", description=main.__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="shared data folder or DiffusionDB JSONL (default: generated prompts)")
    ap.add_argument("--model", type=Path, help="a local WanPipeline folder (default: the tiny one)")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--schedule", default="trace", help="trace | poisson:RATE | closed:N")
    ap.add_argument("--slo-ms", type=float, help="TTFT (time to the image) bound for goodput")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (1 on a shared CPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    make, made = factory(ModelWorkloadOptions(data=args.data, model=args.model, limit=args.limit)), []
    off, on = compare(lambda: made.append(make()) or made[-1], Schedule.parse(args.schedule), progress=True)
    print(summary_table(off, on, SLO(ttft_s=args.slo_ms / 1000 if args.slo_ms else None)))
    text = [1000 * stage_seconds(run).get("text", 0.0) / max(len(run.completed), 1) for run in (off, on)]
    print(f"text encoder per request: off {text[0]:.2f} ms, on {text[1]:.2f} ms ({1 - text[1] / text[0]:.1%} saved); "
          f"outputs on == off bit for bit: {made[0].outputs == made[1].outputs}")


if __name__ == "__main__":
    main()
