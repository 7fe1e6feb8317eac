"""Cached audio encoders on CPU: hit latency against the encoder's own forward, and what the store adds to misses.

    python benchmarks/bench_encoders_audio.py [--repeats 5] [--distinct 8] [--threads N] [--data PATH]

Models: Whisper-base's encoder (d_model 512, 6 layers, 8 heads, ffn 2048, 80 mel bins, 1500 positions) and the
default x-vector SpeakerEncoder, random weights, saved and reloaded. Inputs: PCM WAV bytes, 24 kHz mono 16-bit like
the Seed-TTS prompts (so a miss also resamples to 16 kHz). Store pools are pre-faulted (a long-running server's
are). Baselines are measured in the same run:
- hit table (best of N): a hit (digest of the bytes + lookup + gather) over the encoder forward alone on ready
  features;
- all-miss table: distinct WAVs through the wrapper with the store on and off, back to back, medians per item;
  "direct" is the added work timed alone (digest + key + a miss storing the computed output), which the end-to-end
  difference can only estimate on a loaded machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import best  # noqa: E402  (benchmarks/timing.py, beside this script)

from encoders.audio import CachedAudioEncoder  # noqa: E402
from encoders.speaker import CachedSpeakerEncoder, SpeakerEncoder, SpeakerEncoderConfig  # noqa: E402
from mmcache.encoder_store import EncoderStore  # noqa: E402
from workloads.registry import data_place  # noqa: E402

RATE = 24000


def wav(seed: int, seconds: float) -> bytes:
    """Speech-like test audio: a few drifting harmonics plus noise, 24 kHz mono 16-bit."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.3 * t + seed)
    x = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / RATE) / k for k in range(1, 6)) * 0.2
    x = x + 0.02 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(RATE)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()



def whisper_base(folder: Path):
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel

    config = WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                           num_mel_bins=80, max_source_positions=1500, decoder_layers=1, decoder_attention_heads=8,
                           decoder_ffn_dim=256)
    WhisperModel(config).save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    model, fe = WhisperModel.from_pretrained(folder), WhisperFeatureExtractor.from_pretrained(folder)
    return lambda store: CachedAudioEncoder(model, fe, store)


def speaker(folder: Path):
    SpeakerEncoder(SpeakerEncoderConfig()).save_pretrained(folder)
    model = SpeakerEncoder.from_pretrained(folder)
    return lambda store: CachedSpeakerEncoder(model, store)


def warm_store(capacity: int) -> EncoderStore:
    """A store whose pool memory is already faulted in, as in a server past its first pass over the pool."""
    store = EncoderStore(capacity, 65536)
    store.pool.data.fill_(0)
    return store


def hit_row(name: str, label: str, make, data: bytes, repeats: int) -> str:
    off, on = make(None), make(warm_store(256 << 20))
    features = off.features(off.mono(*off.decode(data)))
    with torch.inference_mode():
        forward = best(lambda: off.encode(features), repeats)
    uncached = best(lambda: off(data), repeats)
    assert torch.equal(on(data), off(data))  # the miss stores, then every call below is a hit
    inner = 200
    hit = best(lambda: on(data), repeats, inner)
    key = best(lambda: on.key(data), repeats, inner)
    k = on.key(data)
    get = best(lambda: on.store.get(k), repeats, inner)
    assert on.store.stats().totals.misses == 1
    return (f"{name:<15}{label:<18}{forward * 1e3:>11.1f}{uncached * 1e3:>11.1f}{hit * 1e3:>9.3f}"
            f"{key * 1e3:>11.3f}{get * 1e3:>9.3f}{hit / forward:>11.3%}")


def miss_row(name: str, make, seconds: float, distinct: int, repeats: int) -> str:
    """Per-item latency over ``repeats * distinct`` fresh WAVs, each run store off and store on back to back (order
    alternating), so the added time is a median of paired differences, robust to drift in the machine's load; the
    medians of the two orders are averaged, so a second-call advantage (warm caches) cancels out."""
    off, on = make(None), make(warm_store(1 << 30))  # one model: the runs differ only by the store
    on_s, off_s, direct = [], [], []
    for r in range(repeats):
        for i in range(distinct):
            data = wav(1000 * (r + 1) + i, seconds)  # never seen: every store-on call is a miss
            pair = [(off, off_s), (on, on_s)]
            for enc, times in pair if len(on_s) % 2 == 0 else pair[::-1]:
                t = time.perf_counter()
                out = enc(data)
                times.append(time.perf_counter() - t)
            t = time.perf_counter()  # the added work alone: digest + key, then a miss that stores ``out``
            on.store.get_or_compute(dataclasses.replace(on.key(data), salt=b"direct"), lambda: out).value
            direct.append(time.perf_counter() - t)
    assert on.store.stats().totals.hits == 0
    m_off, m_direct = statistics.median(off_s), statistics.median(direct)
    diffs = [a - b for a, b in zip(on_s, off_s)]  # pair j ran store-on second when j is even
    added = (statistics.median(diffs[0::2]) + statistics.median(diffs[1::2])) / 2  # the order effect cancels
    return (f"{name:<15}{f'{len(on_s)} x {seconds:g} s':<18}{m_off * 1e3:>11.1f}{statistics.median(on_s) * 1e3:>11.1f}"
            f"{added / m_off:>+11.2%}{m_direct * 1e3:>10.3f}{m_direct / m_off:>10.3%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--distinct", type=int, default=8, help="distinct WAVs per round of the all-miss guard")
    ap.add_argument("--data", type=Path, default=data_place()[0])
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        encoders = {"whisper-base": whisper_base(Path(tmp) / "whisper"), "x-vector": speaker(Path(tmp) / "xvector")}
        inputs = {"whisper-base": [("30 s synthetic", wav(0, 30))], "x-vector": [("30 s synthetic", wav(0, 30))]}
        prompts = sorted((args.data / "seedtts" / "prompt-wavs").glob("*.wav"))
        inputs["x-vector"] += [(f"seedtts {len(b) / 2 / RATE:.1f} s", b) for b in (p.read_bytes() for p in prompts)]
        if not prompts:
            print(f"(no Seed-TTS prompts under {args.data}; real-WAV rows skipped)")

        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n")
        print(f"{'encoder':<15}{'input':<18}{'forward ms':>11}{'uncached':>11}{'hit ms':>9}{'digest+key':>11}"
              f"{'get ms':>9}{'hit/fwd':>11}")
        for name, make in encoders.items():
            for label, data in inputs[name]:
                print(hit_row(name, label, make, data, args.repeats))
        print(f"best of {args.repeats}; hit = digest of the WAV bytes + key + lookup + gather (no decode, resample, "
              f"features or encoder); uncached = the same call with store=None; target hit/fwd < 1%\n")

        print(f"{'encoder':<15}{'items':<18}{'off ms':>11}{'on ms':>11}{'added':>11}{'direct ms':>10}"
              f"{'direct %':>10}")
        for name, make in encoders.items():
            print(miss_row(name, make, 30, args.distinct, args.repeats))
        print("all-miss: per-item medians, store on vs off, same weights; added = median of paired (on - off) "
              "differences / off, both orders averaged;\ndirect = digest + key + a storing miss timed alone; "
              "target added < 1%")


if __name__ == "__main__":
    main()
