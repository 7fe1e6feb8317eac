"""``vlm-mstar``: vlm-chat's questions about images served many-in-flight through M*'s real ``Engine`` with Qwen3-Omni's
thinker and vision encoder (``workloads.harness.mstar_serving``, ``workloads.harness.thinker_steps``), text output
only, with mmcache's KV resource and encoder store or M*'s own KV resource.

Requests: vlm-chat's own (``vlm_chat.load_items``: MMMU-Pro questions with their images under ``--data``, else its
embedded generated images and questions), in vlm-chat's sessions: each item asked by several users, each a first turn
and ``len(vlm_chat_turns.FOLLOW_UPS)`` follow-ups; ``options.limit`` keeps the first requests.

A request's prompt is the thinker's prefill schedule in prompt order, as M*'s ``_build_thinker_prefill_schedule``
makes it (one walk per text span or image, in the order written), in Qwen3-Omni's ChatML layout:

    <|im_start|> system \\n SYSTEM <|im_end|> \\n <|im_start|> user \\n preamble \\n question ... [image] ... options
    <|im_end|> \\n <|im_start|> assistant \\n

where each image is a ``prefill_vision`` walk (the thinker wraps its rows in ``<|vision_start|>``/``<|vision_end|>``
itself) and the text between images one ``prefill_text`` walk. A follow-up (turn ``t + 1``) re-sends turn ``t``'s
whole prompt (its images as vision walks again), the reply turn ``t`` generated, then ``<|im_end|> \\n <|im_start|>
user \\n follow-up <|im_end|> \\n <|im_start|> assistant \\n``, the reply and the follow-up in the prompt's last text
walk (M* splits text at media only). Users of an item share the system prompt's pages and the image's encoder
outputs (their preambles differ before the image); a session's turn reuses everything the turn before it computed,
generated tokens included (the decode walk is named by its token).

Tokens (a tiny vocabulary of Qwen3-Omni's roles, ``workloads.peers.mstar_qwen3_omni``): text is its UTF-8 bytes
(0..255), the ChatML role tokens are ``ROLES`` (``<|im_start|>`` 310, ``<|im_end|>`` 311, ``system`` 312, ``user``
313, ``assistant`` 314), the vision sentinels ``SPECIAL``'s. ``options.max_new_tokens`` tokens are generated per
request, greedily to the end (no stop), so a session's prompts never depend on when sampling would have stopped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np
import xxhash

from digests.media import media_bytes
from mmcache import Fingerprint, ShadowIndex
from mmcache.errors import InvalidMedia, InvalidRequest
from workloads.harness.serving import Request
from workloads.models import vlm_chat
from workloads.models.text import prefix_ceiling, trace_order
from workloads.options import ModelWorkloadOptions
from workloads.traces import vlm_chat_turns
from workloads.traces.mmmu import Part

NAME = "vlm-mstar"
ENGINE = "M*'s Engine (mstar-ai 0.2.1: Qwen3-Omni thinker + vision encoder nodes, text output)"
NL = ord("\n")
IM_START, IM_END, SYSTEM, USER, ASSISTANT = 310, 311, 312, 313, 314  # mstar_qwen3_omni.ROLES
TEXT, IMAGE = "text", "image"


def text_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def system_ids(system: str = vlm_chat_turns.SYSTEM) -> list[int]:
    return [IM_START, SYSTEM, NL, *text_ids(system), IM_END, NL]


def user_ids(text: str) -> list[int]:
    """What follows a user's words: the end of their turn and the assistant's header."""
    return [IM_START, USER, NL, *text_ids(text), IM_END, NL, IM_START, ASSISTANT, NL]


def merged(walks: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    """``walks`` with adjacent text walks joined (M* splits a prompt's text at its media only)."""
    out: list[tuple[str, object]] = []
    for kind, x in walks:
        if kind == TEXT and out and out[-1][0] == TEXT:
            out[-1] = (TEXT, out[-1][1] + list(x))
        elif kind != TEXT or x:
            out.append((kind, list(x) if kind == TEXT else x))
    return out


def first_turn(parts: Sequence[Part], preamble: str, system: str = vlm_chat_turns.SYSTEM) -> list[tuple[str, object]]:
    """A first turn's walks: the system prompt and the user's preamble, then the question's parts (text as ids, an
    image as itself), then the assistant's header."""
    walks = [(TEXT, system_ids(system) + [IM_START, USER, NL, *text_ids(preamble + "\n")])]
    walks += [(TEXT, text_ids(p)) if isinstance(p, str) else (IMAGE, p) for p in parts]
    return merged(walks + [(TEXT, [IM_END, NL, IM_START, ASSISTANT, NL])])


def sessions(items: list[list[list[Part]]], follow_ups: Sequence[str] = vlm_chat_turns.FOLLOW_UPS) -> list[Request]:
    """Every session's requests, listed session by session (vlm-chat's sessions, ``vlm_chat.sessions``' arrivals):
    item ``i``'s user ``u`` asks ``items[i][u]`` after preamble ``u``; payloads are ``vlm_chat.Turn``s whose first
    turn holds its walks, a follow-up its appended ids."""
    reqs, k = [], 0
    tails = [tuple([IM_END, NL, *user_ids(q)]) for q in follow_ups]
    for i, questions in enumerate(items):
        for u, question in enumerate(questions):
            session, start = f"i{i}u{u}", k * vlm_chat.SESSION_GAP_S
            walks = first_turn(question, vlm_chat_turns.PREAMBLES[u % len(vlm_chat_turns.PREAMBLES)])
            reqs.append(Request(f"{session}t0", session, start, vlm_chat.Turn(0, tuple(walks))))
            reqs += [Request(f"{session}t{t}", session, start + t * vlm_chat.TURN_GAP_S,
                             vlm_chat.Turn(t, follow_up=tail)) for t, tail in enumerate(tails, 1)]
            k += 1
    return reqs


# ------------------------------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class VlmMstarFactory:
    """What ``factory`` loads once: the thinker's and the vision tower's weight folders and the requests. Calling it
    gives a fresh ``VlmMstar`` (nothing generated yet)."""

    weights: Path
    vision: Path
    requests: tuple[Request, ...]
    options: ModelWorkloadOptions
    fingerprint: str            # names both folders' weights for the page names

    def __call__(self) -> VlmMstar:
        return VlmMstar(self)


def factory(options: ModelWorkloadOptions) -> VlmMstarFactory:
    """Save (once) the tiny thinker and vision tower, read vlm-chat's items and lay out their sessions."""
    if options.model is not None:
        raise ValueError("vlm-mstar serves a tiny Qwen3-Omni thinker and vision tower built from config (M*'s loader, "
                         "random weights); it takes no --model")
    if options.max_new_tokens < 1:
        raise ValueError(f"vlm-mstar generates max_new_tokens tokens per request: need >= 1, got "
                         f"{options.max_new_tokens}")
    from workloads.peers.mstar_qwen3_omni import save_vision_weights, save_weights

    weights, vision = save_weights(options.model_dir), save_vision_weights(options.model_dir)
    reqs = tuple(sessions(vlm_chat.load_items(options))[:options.limit])
    return VlmMstarFactory(weights, vision, reqs, options, f"qwen3-omni-tiny/{weights.name}/{vision.name}")


class VlmMstar:
    """The ``vlm-mstar`` workload of one run (see the module docstring). ``outputs[rid]``: the token ids a completed
    request generated."""

    TEXT = TEXT  # the kind of a text walk in ``walks``, for what drives the workload
    name = NAME
    engine = ENGINE

    def __init__(self, made: VlmMstarFactory):
        self.made, options = made, made.options
        self.page_size, self.pool_pages, self.encoder_bytes = options.page_size, options.pool_pages, \
            options.encoder_bytes
        self.max_new_tokens = options.max_new_tokens
        self.outputs: dict[str, list[int]] = {}
        self._sent: dict[str, tuple[int, str, list]] = {}  # session -> (turn, rid, walks) of its last request

    def requests(self) -> list[Request]:
        return list(self.made.requests)

    def steps(self, cached: bool, sampled):
        """What drives this workload through M*'s engine (``workloads.harness.thinker_steps``)."""
        from workloads.harness.thinker_steps import ThinkerSteps

        return ThinkerSteps(self, cached, sampled)

    def walks(self, req: Request, generated=None, sent=None) -> list[tuple[str, object]]:
        """``req``'s prefill walks (the layout of the module docstring), recorded as its session's last; a follow-up
        re-sends its session's previous walks and reply (from ``generated``, default ``outputs``):
        ``InvalidRequest`` when that turn did not complete."""
        generated, sent = (self.outputs if generated is None else generated), (self._sent if sent is None else sent)
        turn = req.payload
        if turn.turn == 0:
            walks = list(turn.parts)
        else:
            prev = sent.get(req.session)
            if prev is None or prev[0] != turn.turn - 1 or prev[1] not in generated:
                raise InvalidRequest(f"turn {turn.turn - 1} of session {req.session!r} did not complete: nothing to "
                                     f"follow up on")
            walks = merged([*prev[2], (TEXT, generated[prev[1]]), (TEXT, turn.follow_up)])
        sent[req.session] = (turn.turn, req.rid, walks)
        return walks

    def ceilings(self) -> dict[str, float]:
        """Unbounded-cache hit rates in trace order: prompt rows (every page of a finished request indexed, its
        generated tokens but the last, as M*'s KV resource indexes them; replies stood in by ids drawn from the
        request id, equal exactly where the real ones are) and images seen in an earlier request, over the requests
        that can succeed. An image walk is its rows (``image_rows``) marked with the image's digest."""
        from workloads.peers.mstar_qwen3_omni import image_processor, omni_model

        processor, model, rows = image_processor(), None, {}
        stand_in = {r.rid: [int(x) for x in np.random.default_rng(xxhash.xxh64_intdigest(r.rid.encode())).integers(
            0, 256, self.max_new_tokens)] for r in self.made.requests}
        shadow = ShadowIndex(Fingerprint(model=self.made.fingerprint, page_size=self.page_size))
        sent, seen, images, repeats = {}, set(), 0, 0
        for req in trace_order(self.requests()):
            ids, media = [], []
            try:
                walks = self.walks(req, stand_in, sent)
                keys = [xxhash.xxh3_128_digest(media_bytes(x, "image")) if kind == IMAGE else None for kind, x in walks]
                for (kind, x), key in zip(walks, keys):
                    if kind == IMAGE and key not in rows:
                        model = model or omni_model(self.made.weights)
                        rows[key] = image_rows(model, processor, media_bytes(x, "image"))
            except (InvalidMedia, InvalidRequest):  # a request that cannot succeed: not in the ceiling
                stand_in.pop(req.rid)
                continue
            for (kind, x), key in zip(walks, keys):
                if kind == TEXT:
                    ids += x
                    continue
                media.append((len(ids), key))
                images, repeats = images + 1, repeats + (key in seen)
                seen.add(key)
                ids += [0] * rows[key]
            shadow.admit(req.rid, np.asarray(ids, dtype=np.int32), media=media)
            shadow.finish(req.rid, np.asarray(stand_in[req.rid][:-1], dtype=np.int32))
        return {"prefix": prefix_ceiling(shadow), **({"image": repeats / images} if images else {})}


def image_rows(model, processor, data: bytes) -> int:
    """The rows an image's vision walk feeds the thinker: one per merged 2 x 2 patch of its grid, and its two
    sentinels."""
    from workloads.peers.mstar_qwen3_omni import image_tensors

    return int(image_tensors(model, processor, data)[1].prod()) // 4 + 2
