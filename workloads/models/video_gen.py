"""``video-gen``: text-to-video and image-to-video requests through Wan 2.2 TI2V pipelines, with the umT5 prompt
encoder and the conditioning image's VAE latents cached.

Requests: the prompts of ``image-gen`` (DiffusionDB in order under ``--data``, else generated ones), each with its
own seed and Wan's CFG negative prompt. They come in blocks of ``PROMPTS_PER_IMAGE``: odd blocks animate one
conditioning image with each of their prompts (image-to-video), even blocks are text-to-video, so an image is
animated with several prompts in a row, as users do. Images: the shared MMMU PNGs (``mmmu/images``, sorted, one per
image block, cycling), or without data ``EMBEDDED_IMAGES`` generated PNGs (``vlm_chat.generated_png``).

Serving one request: ``stage("text")`` encodes the prompt and the negative prompt (``ImageGen.embeds``);
``stage("image")`` (image-to-video only) decodes the image and VAE-encodes its condition clip; ``stage("denoise")``
is the rest of the pipeline call, ``stage("decode")`` its VAE decode; ``clock.token()`` marks the finished video,
so **TTFT is the time to the whole video** and ``output_tokens`` counts its frames (throughput in tokens/s is
frames/s). Cache off: the pipeline computes everything. Cache on: prompts through ``CachedPromptEncoder`` and image
latents through ``CachedImageLatents`` over one ``EncoderStore`` (modalities ``"text"``, ``"image"``); a hit skips
the tokenizer and umT5, or the image decode, preprocessing and VAE encode.

Models: ``fixtures.load_wan_ti2v`` (one set of weights behind a ``WanPipeline`` and a ``WanImageToVideoPipeline``,
as Wan 2.2 TI2V-5B serves both; ``options.model``: such a folder). ``CALL``: 5 frames of 16 x 16 px (2 latent
frames), 2 steps, guidance 5 (CFG runs the negative branch).

Invariant: cache on and off produce the same frames bit for bit in the pipeline's dtype (``outputs`` holds an
xxh3-128 of each video's bytes). A request whose image cannot be read or decoded raises ``InvalidMedia`` for that
request alone; nothing is stored for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import xxhash

from digests.media import media_bytes
from mmcache.errors import InvalidMedia
from workloads import fixtures
from workloads.harness.metrics import RequestResult
from workloads.harness.serving import Clock, Request
from workloads.models.image_gen import MAX_SEQUENCE_LENGTH, NEGATIVE_PROMPT, ImageGen, prompt_encoder, prompt_rows
from workloads.options import ModelWorkloadOptions

DEFAULT_REQUESTS = 48  # generated requests when neither data nor a limit is given
PROMPTS_PER_IMAGE = 3
EMBEDDED_IMAGES = 4
MMMU_IMAGES = Path("mmmu") / "images"
CALL = dict(height=16, width=16, num_frames=5, num_inference_steps=2, guidance_scale=5.0, output_type="pt",
            max_sequence_length=MAX_SEQUENCE_LENGTH)


@dataclasses.dataclass(frozen=True)
class Clip:
    """One video request: the prompt, the seed of its initial noise, and its conditioning image (bytes or a path;
    None: text-to-video)."""

    prompt: str
    seed: int
    image: bytes | Path | None = None


@contextlib.contextmanager
def stage_times(pipe, clock: Clock):
    """Time one pipeline call on ``clock``: the conditioning image's preprocessing (``video_processor.preprocess``)
    and ``vae.encode`` as ``"image"``, ``vae.decode`` as ``"decode"``, the rest of the call as ``"denoise"``."""
    from encoders.image_latents import patched

    inner = {"image": 0.0, "decode": 0.0}

    def timed(name: str, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inner[name] += time.perf_counter() - t
        return call

    vae, video, t = pipe.vae, pipe.video_processor, time.perf_counter()
    with patched(vae, "encode", timed("image", vae.encode)), patched(vae, "decode", timed("decode", vae.decode)), \
            patched(video, "preprocess", timed("image", video.preprocess)):
        yield
    total = time.perf_counter() - t
    for name, seconds in {**inner, "denoise": total - sum(inner.values())}.items():
        clock.stages[name] = clock.stages.get(name, 0.0) + seconds


class VideoGen(ImageGen):
    """One replay of video-gen: the shared pipelines, a fresh ``EncoderStore`` for prompts and image latents, and
    ``outputs[rid]``, the xxh3-128 hex digest of each video's bytes."""

    name = "video-gen"

    def __init__(self, t2v, i2v, requests: list[Request], fingerprints: tuple[str, str],
                 ceilings: dict[str, float], encoder_bytes: int):
        super().__init__(t2v, requests, fingerprints[0], ceilings["text"], encoder_bytes)
        from encoders.image_latents import CachedImageLatents

        self.i2v, self._ceilings = i2v, ceilings
        self.latents = CachedImageLatents(i2v, self.store, height=CALL["height"], width=CALL["width"],
                                          num_frames=CALL["num_frames"], fingerprint=fingerprints[1])

    def generate(self, clip: Clip, cached: bool, clock: Clock) -> tuple[torch.Tensor, dict[str, int]]:
        """``(frames [1, F, 3, H, W], hits per modality)`` of ``clip``; hits are 0 with the cache off."""
        embeds, text_hits = self.embeds(clip.prompt, cached, clock)
        hits, pipe, supply, image = {"text": text_hits}, self.pipe, contextlib.nullcontext(), {}
        if clip.image is not None:
            pipe = self.i2v
            with clock.stage("image"):
                data = media_bytes(clip.image, "image")
                if cached:  # the pipeline gets a blank image of the right size and the stored latents
                    found = self.latents.lookup(data)
                    image, supply = self.latents.placeholder(), self.latents.supplied(found.value)
                    hits["image"] = int(found.hit)
                else:
                    from encoders.image_latents import decode
                    image, hits["image"] = decode(data), 0
            image = {"image": image}
        with supply, stage_times(pipe, clock):
            frames = pipe(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], **image,
                          generator=torch.Generator("cpu").manual_seed(clip.seed), **CALL).frames
        return frames, hits

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult:
        frames, hits = self.generate(req.payload, cached, clock)
        clock.token()  # the one output event: the finished video
        self.outputs[req.rid] = xxhash.xxh3_128(frames.detach().cpu().contiguous().view(torch.uint8).numpy()
                                                ).hexdigest()
        return RequestResult(output_tokens=frames.shape[1], encoder_items={m: 2 if m == "text" else 1 for m in hits},
                             encoder_hits=hits, videos=1)

    def ceilings(self) -> dict[str, float]:
        """``text``: 1 - distinct prompt keys / prompt encodes (as ``image-gen``); ``image``: 1 - distinct image
        digests / image-to-video requests whose image can be read. An unbounded store realizes both in any order."""
        return self._ceilings

    def ceiling_weights(self) -> dict[str, int]:
        n = len(self._requests)
        return {"text": 2 * n, "image": sum(r.payload.image is not None for r in self._requests)}


def images(options: ModelWorkloadOptions) -> list[bytes | Path]:
    """The conditioning images: the shared MMMU PNGs under ``options.data``, else generated ones."""
    if options.data is None:
        from workloads.models.vlm_chat import generated_png

        rng = np.random.default_rng(options.seed)
        return [generated_png(k, rng) for k in range(EMBEDDED_IMAGES)]
    found = sorted((Path(options.data) / MMMU_IMAGES).glob("*.png"))
    if not found:
        raise InvalidMedia(f"no conditioning images: no PNG under {Path(options.data) / MMMU_IMAGES}")
    return found


def requests(options: ModelWorkloadOptions) -> list[Request]:
    """Prompts in order, in blocks of ``PROMPTS_PER_IMAGE``: odd blocks animate the next image (cycling)."""
    pictures, out = images(options), []
    for k, (user, prompt) in enumerate(prompt_rows(options, DEFAULT_REQUESTS)):
        block = k // PROMPTS_PER_IMAGE
        image = pictures[(block // 2) % len(pictures)] if block % 2 else None
        out.append(Request(f"r{k}", user or f"r{k}", 0.0, Clip(prompt, options.seed + k, image)))
    return out


def factory(options: ModelWorkloadOptions, dtype: torch.dtype = torch.float32) -> Callable[[], VideoGen]:
    """Load the requests and the pipelines (in ``dtype``) once, fingerprint the text encoder and the VAE once,
    compute the ceilings, and warm every path up (uncached, a miss, a hit); each call of the result is a fresh
    ``VideoGen`` whose store is empty."""
    from encoders.image_latents import CachedImageLatents

    reqs = requests(options)
    t2v, i2v = fixtures.load_wan_ti2v(options, dtype)
    keys = prompt_encoder(t2v, None)
    latents = CachedImageLatents(i2v, None, height=CALL["height"], width=CALL["width"], num_frames=CALL["num_frames"])
    prompts = {keys.key(NEGATIVE_PROMPT), *(keys.key(r.payload.prompt) for r in reqs)}
    conditioned = []
    for r in reqs:
        if r.payload.image is not None:
            with contextlib.suppress(InvalidMedia):
                conditioned.append(latents.key(r.payload.image).digest)
    ceilings = {"text": 1 - len(prompts) / (2 * len(reqs)) if reqs else 0.0,
                "image": 1 - len(set(conditioned)) / len(conditioned) if conditioned else 0.0}
    make = lambda: VideoGen(t2v, i2v, reqs, (keys.fingerprint, latents.fingerprint), ceilings,  # noqa: E731
                            options.encoder_bytes)
    warm, image = make(), images(ModelWorkloadOptions(seed=options.seed))[0]
    for cached in (False, True, True):
        for clip in (Clip("a warm-up prompt", 0), Clip("a warm-up prompt", 0, image)):
            warm.generate(clip, cached, Clock())
    return make
