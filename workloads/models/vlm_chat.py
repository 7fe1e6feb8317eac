"""vlm-chat: multi-turn chats about images through a LLaVA-style model, several users per image.

Sessions: an item (a question with its images, or a generated image) is asked about by several sessions (users),
user ``u`` putting a preamble of its own between the shared system prompt and the question, so users share the
system prompt's pages and then the images' encoder outputs, never each other's history. A session is a first turn
and ``len(FOLLOW_UPS)`` follow-ups; turn ``t + 1`` re-sends turn ``t``'s prompt (its images included) and generated
reply, then a follow-up question.
- real data (``options.data``): the MMMU-Pro questions of ``<data>/mmmu/mmmu_pro_tool_sample_questions.jsonl``,
  each line's ``<image N>`` slots (in the question or the options) filled with ``image_N`` (a path under ``mmmu/``),
  ``REAL_USERS`` users per question;
- embedded default: ``EMBEDDED_IMAGES`` generated PNGs (gradients, shapes, noise: different per image, seeded by
  ``options.seed``), each asked about by ``EMBEDDED_USERS`` users with generated questions.
Text is tokenized with the SentencePiece model of ``mistral_common`` (or the tokenizer of ``options.model``).
Requests are listed session by session; ``options.limit`` keeps the first ones (whole sessions first).

Serving: the tiny LLaVA (a CLIP tower, projector and Llama, hidden 64, 2 layers; or ``options.model``) prefills
``inputs_embeds``: token embeddings with each image's projected features in its placeholder rows. Cache off: every
request decodes, preprocesses and encodes every image it holds and prefills every token. Cache on: a
``PagedKVCache`` whose page names carry the images' digests (``mmcache.hf.llava``) and an ``EncoderStore``; only images
with a placeholder past the matched prefix are encoded, through the store. Stages: ``image`` (digests and encoder),
``prefill``; ``Clock.token()`` at each generated token. A turn whose image file is missing raises ``InvalidMedia``;
a follow-up of a failed turn raises ``InvalidRequest`` (it has no history to re-send).

Invariants:
- exactness: cache on and off generate the same tokens bit for bit (``outputs`` holds them per request id): every
  indexed page is a prompt page written by the page-sized prefill chunk the cache-off run also computes it with
  (``agent_model.serve_request``), and features come from the store as they were computed;
- ``encoder_items["image"]`` counts the images in the prompt, ``encoder_hits["image"]`` those the vision tower did
  not run for (found in the store, or entirely inside the matched prefix); the ``image`` ceiling is the share of
  image occurrences seen in an earlier request, which unbounded caches avoid exactly.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import string
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw
from transformers import (AutoImageProcessor, AutoModelForImageTextToText, CLIPImageProcessorPil, CLIPVisionConfig,
                          LlamaConfig, LlavaConfig)

from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape
from mmcache.hf.runner import Embed
from encoders.vision import CachedVisionEncoder
from mmcache.hf.llava import LlavaPrefill, VlmPrompt
from mmcache import EncoderStore, ShadowIndex
from mmcache.errors import EncoderOutputError, InvalidMedia, InvalidRequest, TraceError

from workloads import registry
from workloads.models.agent import (check_vocab, load_model, prefix_ceiling, serve_request, text_tokenizer, tiny_llama_config,
                          trace_order)
from workloads.harness.metrics import RequestResult
from workloads.options import ModelWorkloadOptions
from workloads.harness.serving import Clock, Request

SYSTEM = ("You are a careful assistant. You answer questions about the images the user shows, citing what you see "
          "in them, and you give the letter of the option you choose.")
PREAMBLES = ("Answer with the letter of the correct option.",
             "Think step by step about the figure, then give the letter of your answer.",
             "I am studying for an exam. Explain briefly and give the answer.")
FOLLOW_UPS = ("Why is that option correct? Point to the part of the image that shows it.",
              "Which other option is the most tempting distractor, and why is it wrong?")
REAL_USERS = 2
EMBEDDED_IMAGES, EMBEDDED_USERS = 4, 3
SESSION_GAP_S, TURN_GAP_S = 2.0, 6.0  # arrivals: session k starts at k * SESSION_GAP_S, turns TURN_GAP_S apart
IMAGE_PX, PATCH_PX = 64, 8            # tiny CLIP tower: 64 placeholders per image
ENCODER_PAGE_BYTES = 1 << 14

Part = str | Path | bytes  # text, an image file, or image bytes


@dataclasses.dataclass(frozen=True)
class Turn:
    """A request's payload: the session's first prompt as parts (token ids and images), or, for a follow-up
    (``turn > 0``), the tokens it appends after the previous turn's prompt and reply."""

    turn: int
    parts: tuple = ()
    follow_up: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Done:
    """A served turn: what the session's next turn re-sends."""

    turn: int
    prompt: VlmPrompt
    output: list[int]


# --------------------------------------------------------------------------------------------------------- data
def _slots(text: str, images: dict[int, Part]) -> list[Part]:
    """``text`` split at its ``<image N>`` slots, each replaced by ``images[N]``."""
    parts: list[Part] = []
    for k, piece in enumerate(re.split(r"<image (\d+)>", text)):
        if k % 2 == 0:
            parts += [piece] if piece else []
        elif int(piece) in images:
            parts.append(images[int(piece)])
        else:
            raise ValueError(f"<image {piece}> but no image_{piece}")
    return parts


def _question(question: str, options: Sequence[str], images: dict[int, Part]) -> list[Part]:
    """The question, then its options lettered (A), (B), ..., images in their slots."""
    parts = _slots(question, images) + ["\nOptions:"]
    for letter, option in zip(string.ascii_uppercase, options):
        parts += [f"\n({letter}) "] + _slots(option, images)
    return parts


def load_mmmu(path: Path) -> list[list[Part]]:
    """One question (text and image paths) per line of an MMMU-Pro JSONL file; ``TraceError`` with the file and
    line for anything malformed (image files are checked when served, not here)."""
    if not path.is_file():
        raise TraceError(path, None, "no such file")
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, options = row["question"], row["options"]
            if not isinstance(question, str) or not isinstance(options, list) or not all(
                    isinstance(o, str) for o in options):
                raise ValueError("'question' must be a string and 'options' a list of strings")
            images = {int(k.removeprefix("image_")): path.parent / v for k, v in row.items()
                      if re.fullmatch(r"image_\d+", k) and isinstance(v, str) and v}
            items.append(_question(question, options, images))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise TraceError(path, lineno, f"{type(e).__name__}: {e}") from None
    if not items:
        raise TraceError(path, None, "no questions")
    return items


def generated_png(k: int, rng: np.random.Generator) -> bytes:
    """A PNG of a few hundred pixels a side, drawn by ``k % 4``: a gradient, stripes or noise, under random shapes."""
    w, h = (int(v) for v in rng.integers(160, 420, 2))
    y, x = np.mgrid[0:h, 0:w]
    kind = k % 4
    if kind == 0:
        pixels = np.stack([255 * x / w, 255 * y / h, np.full((h, w), rng.integers(256))], -1)
    elif kind == 2:
        pixels = rng.integers(0, 256, (h, w, 3))
    else:
        pixels = np.broadcast_to(rng.integers(0, 256, 3), (h, w, 3)) * (1 - 0.5 * ((x // (8 + k)) % 2))[..., None]
    img = Image.fromarray(pixels.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        box = (x0, y0, x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2)))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if kind in (0, 3) else draw.rectangle)(box, fill=fill)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


_NOUNS = ("circle", "region", "curve", "block", "border", "pattern", "shadow", "corner", "stripe", "area")
_ADJECTIVES = ("largest", "brightest", "leftmost", "darkest", "upper", "central", "smallest", "red", "blue")


def embedded_items(seed: int) -> list[list[list[Part]]]:
    """Per generated image, ``EMBEDDED_USERS`` generated questions about it (image bytes in the parts)."""
    rng = np.random.default_rng(seed)
    items = []
    for k in range(EMBEDDED_IMAGES):
        image = generated_png(k, rng)
        questions = []
        for _ in range(EMBEDDED_USERS):
            adj, noun = rng.choice(_ADJECTIVES), rng.choice(_NOUNS)
            options = [f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}" for _ in range(int(rng.integers(4, 7)))]
            questions.append(_question(f"<image 1>\nWhat does the {adj} {noun} in the image touch?", options,
                                       {1: image}))
        items.append(questions)
    return items


def sessions(items: list[list[list[Part]]], tokenize: Callable[[str], list[int]], bos: int) -> list[Request]:
    """Requests of every session, listed session by session: item ``i``'s user ``u`` asks ``items[i][u]``."""
    reqs, k = [], 0
    head = [bos, *tokenize(f"[system]\n{SYSTEM}\n")]
    follow_ups = [tuple(tokenize(f"\n[user]\n{q}\n[assistant]\n")) for q in FOLLOW_UPS]
    for i, questions in enumerate(items):
        for u, question in enumerate(questions):
            text = [tokenize(p) if isinstance(p, str) else p for p in
                    [f"[user]\n{PREAMBLES[u % len(PREAMBLES)]}\n", *question, "\n[assistant]\n"]]
            session, start = f"i{i}u{u}", k * SESSION_GAP_S
            reqs.append(Request(f"{session}t0", session, start, Turn(0, (head, *text))))
            reqs += [Request(f"{session}t{t}", session, start + t * TURN_GAP_S, Turn(t, follow_up=f))
                     for t, f in enumerate(follow_ups, 1)]
            k += 1
    return reqs


# ------------------------------------------------------------------------------------------------------ the workload
class VlmChat:
    """One run of vlm-chat (see the module docstring); ``outputs`` maps each completed request to its tokens."""

    name = "vlm-chat"

    def __init__(self, plain: LlavaPrefill, processor, requests: list[Request], options: ModelWorkloadOptions):
        model = plain.model
        self.plain, self._requests = plain, requests
        self.page_size, self.max_new_tokens = options.page_size, options.max_new_tokens
        fingerprint = plain.encoder.fingerprint
        self.kv = PagedKVCache.for_model(model, options.pool_pages, options.page_size, fingerprint=fingerprint)
        self.store = EncoderStore(options.encoder_bytes, ENCODER_PAGE_BYTES)
        self.encoder = CachedVisionEncoder(model, processor, self.store, fingerprint=fingerprint)
        self.outputs: dict[str, list[int]] = {}
        self._history: dict[str, _Done] = {}
        self._ceilings: tuple[dict, dict] | None = None

    def requests(self) -> list[Request]:
        return self._requests

    def prompt(self, req: Request, history: dict[str, _Done]) -> VlmPrompt:
        """The request's prompt: its parts (reading image files) for a first turn, else the previous turn's prompt
        and reply in ``history`` followed by the follow-up."""
        turn = req.payload
        if turn.turn == 0:
            return self.plain.prompt(*turn.parts)
        prev = history.get(req.session)
        if prev is None or prev.turn != turn.turn - 1:
            raise InvalidRequest(f"turn {turn.turn - 1} of session {req.session!r} did not complete: nothing to "
                                 f"follow up on")
        return self.plain.prompt(prev.prompt, prev.output, turn.follow_up)

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult:
        prompt = self.prompt(req, self._history)
        n, P, T = len(prompt.token_ids), self.page_size, self.plain.tokens_per_image
        encoder, media = self.plain.encoder, ()
        if cached:
            encoder = self.encoder
            with clock.stage("image"):
                media = [(off, encoder.key(data).digest) for off, data in prompt.images]
        misses = self._misses()

        def prepare(matched: int) -> Embed:
            with clock.stage("image"):
                features = {off: encoder(data) for off, data in prompt.images if off + T > matched}
            if any(f.shape[0] != T for f in features.values()):
                raise EncoderOutputError(f"the vision encoder gave {[f.shape[0] for f in features.values()]} rows "
                                         f"for images of {T} placeholders")
            return _embedder(self.plain.model, prompt, features, T)

        out, matched = serve_request(self.plain.model, self.kv if cached else None, req.rid, prompt.token_ids, P,
                                     max_new_tokens=self.max_new_tokens, clock=clock, media=media, prepare=prepare)
        self.outputs[req.rid] = out
        self._history[req.session] = _Done(req.payload.turn, prompt, out)
        images = len(prompt.images)
        return RequestResult(prompt_tokens=n, hit_tokens=matched, prompt_pages=n // P, hit_pages=matched // P,
                             output_tokens=len(out), encoder_items={"image": images},
                             encoder_hits={"image": images - (self._misses() - misses) if cached else 0})

    def _misses(self) -> int:
        return self.store.stats().to_dict()["by_modality"].get("image", {}).get("misses", 0)

    def cache_stats(self) -> dict:
        return {"prefix": self.kv.prefix.stats().to_dict(), "encoder": self.store.stats().to_dict()}

    def ceilings(self) -> dict[str, float]:
        """Unbounded-cache hit rates in trace order over the requests that can succeed. Replies are stood in by zeros:
        only prompt pages are indexed, and a reply is re-sent only inside its own session, so which tokens it holds
        changes no match, only its length does."""
        return self._shadow()[0]

    def ceiling_weights(self) -> dict[str, int]:
        """What each ceiling is a share of (prompt tokens, images), so a blend of workloads can weigh them."""
        return self._shadow()[1]

    def _shadow(self) -> tuple[dict, dict]:
        if self._ceilings is not None:
            return self._ceilings
        shadow, history, seen, images, repeats = ShadowIndex(self.kv.prefix.fingerprint), {}, set(), 0, 0
        for req in trace_order(self._requests):
            try:
                prompt = self.prompt(req, history)
            except (InvalidMedia, InvalidRequest):
                continue
            digests = [self.encoder.key(data).digest for _, data in prompt.images]
            images += len(digests)
            for d in digests:
                repeats += d in seen
                seen.add(d)
            shadow.admit(req.rid, prompt.token_ids, media=[(off, d) for (off, _), d in zip(prompt.images, digests)])
            shadow.finish(req.rid)  # prompt pages only, as served
            history[req.session] = _Done(req.payload.turn, prompt, [0] * self.max_new_tokens)
        tokens = sum(r.prompt_tokens for r in shadow.records)
        self._ceilings = ({"prefix": prefix_ceiling(shadow), **({"image": repeats / images} if images else {})},
                          {"prefix": tokens, "image": images})
        return self._ceilings


@torch.inference_mode()
def _embedder(model, prompt: VlmPrompt, features: dict[int, torch.Tensor], T: int) -> Embed:
    """``embed(start, end)``: ``inputs_embeds`` rows of ``prompt``, each image's ``features`` in its ``T`` placeholder
    rows (what ``LlavaModel`` scatters); only rows of images in ``features`` may be asked for."""
    table = model.get_input_embeddings()
    ids = torch.tensor(prompt.token_ids, device=table.weight.device)[None]

    def embed(start: int, end: int) -> torch.Tensor:
        rows = table(ids[:, start:end])
        for off, f in features.items():
            lo, hi = max(start, off), min(end, off + T)
            if lo < hi:
                rows[0, lo - start:hi - start] = f[lo - off:hi - off]
        return rows

    return embed


def tiny_llava_config(vocab_size: int) -> LlavaConfig:
    """CLIP tower (hidden 32, 2 layers, 64 x 64 px in 8 px patches) + projector + tiny Llama; the image token is the
    last id, past the text vocabulary."""
    text: LlamaConfig = tiny_llama_config(vocab_size + 1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              patch_size=PATCH_PX, image_size=IMAGE_PX)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=vocab_size)


def factory(options: ModelWorkloadOptions) -> Callable[[], VlmChat]:
    """Load the model (tiny LLaVA unless ``options.model``), its image processor and the sessions once; each call
    returns a fresh ``VlmChat`` (empty prefix cache and encoder store)."""
    tok = text_tokenizer(options.model)
    processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_PX},
                                      crop_size={"height": IMAGE_PX, "width": IMAGE_PX})
    model, folder = load_model(AutoModelForImageTextToText, options, "tiny-llava", tiny_llava_config(32768),
                               processor.save_pretrained, model_types=("llava",))
    kv_page_shape(model.config, options.page_size)  # ValueError now, for a model whose KV pages cannot stand for
    processor = AutoImageProcessor.from_pretrained(folder)
    if options.data is None:
        items = embedded_items(options.seed)
    else:
        path = Path(options.data) / registry.MODEL_WORKLOADS["vlm-chat"].data_path
        items = [[q] * REAL_USERS for q in load_mmmu(path)]
    reqs = sessions(items, lambda text: tok.encode([text])[0], tok.bos_id())[:options.limit]
    vocab = model.config.get_text_config(decoder=True).vocab_size
    check_vocab(reqs, lambda r: [t for p in (*r.payload.parts, r.payload.follow_up) if not isinstance(p, (Path, bytes))
                                 for t in p], vocab)
    plain = LlavaPrefill(model, processor)
    return lambda: VlmChat(plain, processor, reqs, options)
