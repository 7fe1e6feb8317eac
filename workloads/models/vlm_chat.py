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

Serving: one request goes workload -> ``LlavaPrefill.serve`` (digests each image once, looks its features up under
the request's salt) -> ``runner.serve`` -> ``PagedKVCache`` -> the core, and back once. The tiny LLaVA of
``workloads.fixtures`` (a CLIP tower, projector and Llama, hidden 64, 2 layers; or ``options.model``) prefills
``inputs_embeds``: token embeddings with each image's projected features in its placeholder rows. Cache off: every
request decodes, preprocesses and encodes every image it holds and prefills every token. Cache on: a
``PagedKVCache`` whose page names carry the images' digests (``encoders.llava``) and an ``EncoderStore``; only images
with a placeholder past the matched prefix are encoded, through the store. Stages: ``image`` (digests and encoder),
``prefill``; ``Clock.token()`` at each generated token. A turn whose image file is missing raises ``InvalidMedia``;
a follow-up of a failed turn raises ``InvalidRequest`` (it has no history to re-send).

Invariants:
- exactness: cache on and off generate the same tokens bit for bit (``outputs`` holds them per request id): every
  indexed page is a prompt page written by the page-sized prefill chunk the cache-off run also computes it with
  (``mmcache.hf.runner.serve`` without ``index_output``), and features come from the store as they were computed;
- ``encoder_items["image"]`` counts the images in the prompt, ``encoder_hits["image"]`` those the vision tower did
  not run for (found in the store, or entirely inside the matched prefix); the ``image`` ceiling is the share of
  image occurrences seen in an earlier request, which unbounded caches avoid exactly.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw

from encoders.llava import LlavaPrefill, VlmPrompt
from mmcache import EncoderStore, ShadowIndex
from mmcache.errors import InvalidMedia, InvalidRequest
from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape
from workloads import fixtures, registry
from workloads.harness.metrics import RequestResult
from workloads.harness.serving import Clock, Request
from workloads.models.text import check_vocab, prefix_ceiling, timed, trace_order
from workloads.options import ModelWorkloadOptions
from workloads.traces.mmmu import Part, load_mmmu
from workloads.traces.mmmu import question_parts as _question
from workloads.traces.vlm_chat_turns import FOLLOW_UPS, PREAMBLES, SYSTEM

REAL_USERS = 2
EMBEDDED_IMAGES, EMBEDDED_USERS = 4, 3
SESSION_GAP_S, TURN_GAP_S = 2.0, 6.0  # arrivals: session k starts at k * SESSION_GAP_S, turns TURN_GAP_S apart
ENCODER_PAGE_BYTES = 1 << 14



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


def sessions(items: list[list[list[Part]]], tokenize: Callable[[str], list[int]], bos: int, *, system: str = SYSTEM,
             follow_ups: tuple[str, ...] = FOLLOW_UPS) -> list[Request]:
    """Requests of every session, listed session by session: item ``i``'s user ``u`` asks ``items[i][u]``."""
    reqs, k = [], 0
    head = [bos, *tokenize(f"[system]\n{system}\n")]
    follow_ups = [tuple(tokenize(f"\n[user]\n{q}\n[assistant]\n")) for q in follow_ups]
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
    """One run of vlm-chat (see the module docstring); ``outputs`` maps each completed request to its tokens. The
    media are those of ``plain`` (images, or clips for a video prefill: ``video-chat``), counted under its encoder's
    modality."""

    name = "vlm-chat"

    def __init__(self, plain: LlavaPrefill, processor, requests: list[Request], options: ModelWorkloadOptions):
        model, fingerprint = plain.model, plain.encoder.fingerprint
        self.plain, self._requests, self.modality = plain, requests, plain.encoder.modality
        self.page_size, self.max_new_tokens = options.page_size, options.max_new_tokens
        self.kv = PagedKVCache.for_model(model, options.pool_pages, options.page_size, fingerprint=fingerprint)
        self.store = EncoderStore(options.encoder_bytes, ENCODER_PAGE_BYTES)
        self.llava = LlavaPrefill(model, processor, self.kv, self.store, fingerprint=fingerprint,
                                  sampling=getattr(plain.encoder, "sampling", None))
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
        n, P = len(prompt.token_ids), self.page_size
        served = (self.llava if cached else self.plain).serve(
            req.rid, prompt, max_new_tokens=self.max_new_tokens, chunk_tokens=P, index_output=False, **timed(clock))
        out, matched = served.output_ids, served.matched_tokens
        self.outputs[req.rid] = out
        self._history[req.session] = _Done(req.payload.turn, prompt, out)
        return RequestResult(prompt_tokens=n, hit_tokens=matched, prompt_pages=n // P, hit_pages=matched // P,
                             output_tokens=len(out), encoder_items={self.modality: len(prompt.items)},
                             encoder_hits={self.modality: served.encoder_hits})

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
            digests = [d for _, d in self.llava.media(prompt)]
            images += len(digests)
            for d in digests:
                repeats += d in seen
                seen.add(d)
            shadow.admit(req.rid, prompt.token_ids, media=[(off, d) for (off, _), d in zip(prompt.items, digests)])
            shadow.finish(req.rid)  # prompt pages only, as served
            history[req.session] = _Done(req.payload.turn, prompt, [0] * self.max_new_tokens)
        tokens = sum(r.prompt_tokens for r in shadow.records)
        self._ceilings = ({"prefix": prefix_ceiling(shadow), **({self.modality: repeats / images} if images else {})},
                          {"prefix": tokens, self.modality: images})
        return self._ceilings


def factory(options: ModelWorkloadOptions) -> Callable[[], VlmChat]:
    """Load the model (tiny LLaVA unless ``options.model``), its image processor and the sessions once; each call
    returns a fresh ``VlmChat`` (empty prefix cache and encoder store)."""
    tok = fixtures.text_tokenizer(options.model)
    model, processor, _ = fixtures.load_llava(options)
    kv_page_shape(model.config, options.page_size)  # ValueError now, for a model whose KV pages cannot stand for
    return chats(model, processor, load_items(options), tok, options)


def load_items(options: ModelWorkloadOptions) -> list[list[list[Part]]]:
    """Per item, the question each of its users asks: ``REAL_USERS`` users of each MMMU-Pro question under
    ``options.data``, else the embedded default (``embedded_items``); reads nothing outside the data folder given."""
    if options.data is None:
        return embedded_items(options.seed)
    path = Path(options.data) / registry.MODEL_WORKLOADS["vlm-chat"].data_path
    return [[q] * REAL_USERS for q in load_mmmu(path)]


def chats(model, processor, items: list[list[list[Part]]], tok, options: ModelWorkloadOptions, *, cls=None,
          sampling=None, **texts) -> Callable[[], VlmChat]:
    """What builds a fresh ``cls`` (default ``VlmChat``) per run over the ``sessions`` of ``items`` (``texts``:
    their ``system`` and ``follow_ups``), tokenized by ``tok`` and checked against the model's vocabulary;
    ``sampling``: the media are clips sampled so."""
    reqs = sessions(items, lambda text: tok.encode([text])[0], tok.bos_id(), **texts)[:options.limit]
    vocab = model.config.get_text_config(decoder=True).vocab_size
    check_vocab(reqs, lambda r: [t for p in (*r.payload.parts, r.payload.follow_up) if not isinstance(p, (Path, bytes))
                                 for t in p], vocab)
    plain = LlavaPrefill(model, processor, sampling=sampling)
    return lambda: (cls or VlmChat)(plain, processor, reqs, options)
