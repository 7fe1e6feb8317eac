"""TinyChat: a real tiny multimodal serving workload for the harness tests (used through conftest's fixtures).

It is a real workload, not a mock: torch modules encode real PNG and WAV files, prefill runs an MLP over every
uncached prompt token, decode runs one step per output token, and the cache-on path goes through a real PrefixCache
(metadata-only pool) and a real EncoderStore.
"""

import dataclasses
import wave
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

import digests
from mmcache import EncoderKey, EncoderStore, Fingerprint, PagePool, PrefixCache, ShadowIndex
from workloads.harness.metrics import RequestResult
from workloads.harness.serving import Request

P = 16          # tokens per page
WIDTH = 384     # hidden size: prefill costs ~1.2 MFLOP per uncached token
PLACEHOLDER = 1  # image placeholder token id (16 of them, one page)


def make_media(root: Path) -> dict[str, Path]:
    """Two random 64x64 PNG images and a 0.5 s 16 kHz WAV voice, written as real files."""
    rng = np.random.default_rng(0)
    paths = {}
    for k in range(2):
        paths[f"img{k}"] = root / f"img{k}.png"
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(paths[f"img{k}"])
    paths["voice"] = root / "voice.wav"
    with wave.open(str(paths["voice"]), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(rng.integers(-3000, 3000, 8000, dtype=np.int16).tobytes())
    return paths


class TinyModel(nn.Module):
    """A vision tower, a speaker encoder, a 4-layer MLP "language model" and a vocoder, seeded."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():  # seeded weights, the caller's RNG untouched
            torch.manual_seed(0)
            self._build()
        self.eval()

    def _build(self):
        self.embed = nn.Embedding(1024, WIDTH)
        self.mlp = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())))
        self.vision = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 128, 3, stride=2),
                                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, WIDTH))
        self.speaker = nn.Sequential(nn.Conv1d(1, 64, 9, stride=2), nn.GELU(), nn.Conv1d(64, 128, 9, stride=2),
                                     nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(128, WIDTH))
        self.vocoder = nn.Linear(WIDTH, 1024)

    @torch.inference_mode()
    def encode(self, modality: str, path: Path) -> torch.Tensor:
        if modality == "image":
            pixels = np.asarray(digests.open_image(path).convert("RGB"), dtype=np.float32) / 255
            return self.vision(torch.from_numpy(pixels).permute(2, 0, 1)[None])[0]
        wav, _ = digests.load_wav(path)
        return self.speaker(wav[None])[0]

    @torch.inference_mode()
    def prefill(self, tokens: np.ndarray, features: list[torch.Tensor]) -> torch.Tensor:
        h = self.mlp(self.embed(torch.from_numpy(tokens.astype(np.int64))))
        return h[-1] + sum(features, torch.zeros(WIDTH))

    @torch.inference_mode()
    def decode(self, h: torch.Tensor, token: int) -> torch.Tensor:
        return self.mlp(h + self.embed.weight[token])

    @torch.inference_mode()
    def vocode(self, h: torch.Tensor) -> torch.Tensor:
        return self.vocoder(h)


@dataclasses.dataclass(frozen=True)
class TinyTurn:
    tokens: np.ndarray        # the whole prompt: history + this turn's user tokens
    output: np.ndarray        # the reply (decode is teacher-forced, so the next turn's history is known)
    image: Path | None        # an image whose placeholder page starts at image_at
    image_at: int
    voice: Path | None        # speak the reply in this reference voice


class TinyChat:
    """Sessions of turns re-sending their history after a shared 3-page system prompt; turn 0 shows an image (two
    distinct images over the sessions), the last turn speaks its reply in one shared voice. ``missing``: request ids
    whose image file does not exist (serve raises InvalidMedia)."""

    name = "tiny-chat"

    def __init__(self, model: TinyModel, media: dict[str, Path], sessions: int = 3, turns: int = 6,
                 pool_pages: int = 512, missing: frozenset = frozenset()):
        self.model = model
        self.cache = PrefixCache(PagePool(pool_pages), Fingerprint(model="tiny-chat", page_size=P))
        self.store = EncoderStore(capacity_bytes=1 << 20, page_bytes=4096)
        rng = np.random.default_rng(1)
        system = rng.integers(10, 1024, 3 * P, dtype=np.int32)
        self._requests = []
        for s in range(sessions):
            history = system
            for t in range(turns):
                rid, user = f"s{s}t{t}", rng.integers(10, 1024, 64, dtype=np.int32)
                image = None
                if t == 0:
                    image = media[f"img{s % 2}"] if rid not in missing else media["img0"].with_name("missing.png")
                    user = np.concatenate([np.full(P, PLACEHOLDER, np.int32), user])
                tokens = np.concatenate([history, user])
                turn = TinyTurn(tokens, rng.integers(10, 1024, 12, dtype=np.int32), image, history.size,
                            media["voice"] if t == turns - 1 else None)
                self._requests.append(Request(rid, f"s{s}", 1000.0 + 0.5 * t + 0.1 * s, turn))
                history = np.concatenate([tokens, turn.output])

    def requests(self):
        return self._requests

    def _encode(self, modality: str, path: Path, cached: bool):
        """(features, hit, digest); the digest is None with the cache off (nothing needs it)."""
        if not cached:
            return self.model.encode(modality, path), False, None
        digest = digests.image(path) if modality == "image" else digests.audio(path)
        found = self.store.get_or_compute(EncoderKey(digest, f"tiny-{modality}", modality),
                                          lambda: self.model.encode(modality, path))
        return found.value, found.hit, digest

    def serve(self, req: Request, cached: bool, clock) -> RequestResult:
        turn, media, features, items, hits = req.payload, [], [], {}, {}
        for modality, path in (("image", turn.image), ("speaker", turn.voice)):
            if path is not None:
                with clock.stage(modality):
                    f, hit, digest = self._encode(modality, path, cached)
                features.append(f)
                items[modality], hits[modality] = 1, int(hit)
                if modality == "image" and digest is not None:
                    media.append((turn.image_at, digest))
        n, out, matched = turn.tokens.size, turn.output, 0
        if cached:  # media are encoded (or failed) before admit, so a bad file leaves the cache untouched
            matched = self.cache.admit(req.rid, turn.tokens, media=media).matched_tokens
            try:
                self.cache.grow(req.rid, n + out.size)
            except BaseException:
                self.cache.abort(req.rid)
                raise
        with clock.stage("prefill"):
            h = self.model.prefill(turn.tokens[matched:], features)
        clock.token()
        for token in out[:-1]:
            h = self.model.decode(h, int(token))
            clock.token()
        if turn.voice is not None:
            for _ in range(4):
                self.model.vocode(h)
                clock.audio_chunk()
        if cached:
            self.cache.mark_computed(req.rid, n + out.size - 1)  # the last sampled token's KV is never written
            self.cache.finish(req.rid, out)
        return RequestResult(prompt_tokens=n, hit_tokens=matched, prompt_pages=n // P, hit_pages=matched // P,
                             output_tokens=out.size, encoder_items=items, encoder_hits=hits)

    def cache_stats(self) -> dict:
        return {"prefix": self.cache.stats().to_dict(), "encoder": self.store.stats().to_dict()}

    def ceilings(self) -> dict[str, float]:
        """Unbounded-cache hit rates over the requests that will succeed, in listed order (for this workload the
        same as in any order that keeps each session's turns in order)."""
        shadow, seen, items, hits = ShadowIndex(self.cache.fingerprint), set(), Counter(), Counter()
        for req in self._requests:
            turn = req.payload
            paths = {"image": turn.image, "speaker": turn.voice}
            if any(p is not None and not p.exists() for p in paths.values()):
                continue
            for m, p in paths.items():
                if p is not None:
                    items[m] += 1
                    hits[m] += p in seen
                    seen.add(p)
            media = [(turn.image_at, digests.image(turn.image))] if turn.image else []
            shadow.admit(req.rid, turn.tokens, media=media)
            shadow.finish(req.rid, turn.output[:-1])
        prompt = sum(r.prompt_tokens for r in shadow.records)
        return {"prefix": sum(r.matched_pages for r in shadow.records) * P / prompt,
                **{m: hits[m] / items[m] for m in items}}
