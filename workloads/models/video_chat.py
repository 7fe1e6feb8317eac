"""``video-chat``: multi-turn questions about short video clips through a LLaVA-NeXT-Video model.

The serving path, sessions and invariants are ``vlm-chat``'s (``workloads.models.vlm_chat``) with clips for images:
each clip is ``tokens_per_video`` ``<video>`` placeholders whose page carries ``digests.video`` of the container bytes
plus the frame sampling and video processor (same clip + same text hits, a different clip or another sampling never),
and its features (``get_video_features``: CLIP per frame, 2 x 2 spatial pooling, projector) go through the encoder
store under modality ``"video"``. Each clip is asked about by ``USERS`` users, each session a first question and
two follow-ups that re-send the history with the clip, so turn 2 and 3 hit the prefix and users 2+ hit the store.

Clips (``workloads.traces.clips``: a pan across a still, 8 frames at 8 fps, 64 x 64 px, MPEG-4 Part 2 in MP4 written
by PyAV), sampled at ``SAMPLING`` (4 frames evenly spaced):
- real data (``options.data``): one clip per shared MMMU PNG (``mmmu/images``, sorted), written once into
  ``<model_dir>/../clips`` and read from there;
- embedded default: one clip per ``EMBEDDED_CLIPS`` generated PNG (``vlm_chat.generated_png``), in memory.
A clip that is not a readable video, is truncated, or is shorter than the sampling fails its session's requests
alone (``InvalidMedia``, then ``InvalidRequest`` for its follow-ups); nothing is stored for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from digests import FrameSampling
from workloads import fixtures
from workloads.models.vlm_chat import VlmChat, chats, generated_png
from workloads.options import ModelWorkloadOptions
from workloads.traces.clips import clip_files, pan_clip
from workloads.traces.vlm_chat_turns import PREAMBLES

SYSTEM = ("You are a careful assistant. You answer questions about the video the user shows, describing what moves "
          "and what stays, frame by frame when it helps.")
QUESTIONS = ("What does the camera pass over in this clip?", "Which part of the scene appears last?",
             "Describe the colours that dominate the clip.", "What stays in view for the whole clip?")
FOLLOW_UPS = ("Which frame shows it most clearly, and why?", "What would the next second of the clip show?")
SAMPLING = FrameSampling(num_frames=4)
USERS = len(PREAMBLES)
EMBEDDED_CLIPS = 3
MMMU_IMAGES = Path("mmmu") / "images"


class VideoChat(VlmChat):
    name = "video-chat"


def clips(options: ModelWorkloadOptions) -> list[bytes | Path]:
    """The clips: files made once from the shared MMMU images under ``options.data``, else generated in memory."""
    if options.data is None:
        rng = np.random.default_rng(options.seed)
        return [pan_clip(generated_png(k, rng)) for k in range(EMBEDDED_CLIPS)]
    images = [p.read_bytes() for p in sorted((Path(options.data) / MMMU_IMAGES).glob("*.png"))]
    return clip_files(images, Path(options.model_dir).parent / "clips")


def items(videos: list[bytes | Path]) -> list[list[list]]:
    """Per clip, ``USERS`` questions about it: the clip, then a question (rotating through ``QUESTIONS``)."""
    return [[[video, f"\n{QUESTIONS[(i + u) % len(QUESTIONS)]}"] for u in range(USERS)]
            for i, video in enumerate(videos)]


def factory(options: ModelWorkloadOptions) -> Callable[[], VideoChat]:
    """Load the model (tiny LLaVA-NeXT-Video unless ``options.model``), its video processor and the sessions once;
    each call returns a fresh ``VideoChat`` (empty prefix cache and encoder store)."""
    from mmcache.hf.paged_kv import kv_page_shape

    tok = fixtures.text_tokenizer(options.model)
    model, processor, _ = fixtures.load_llava_next_video(options)
    kv_page_shape(model.config, options.page_size)
    return chats(model, processor, items(clips(options)), tok, options, cls=VideoChat, sampling=SAMPLING,
                 system=SYSTEM, follow_ups=FOLLOW_UPS)
