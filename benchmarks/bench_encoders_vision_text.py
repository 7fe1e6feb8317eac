"""Encoder store on a CLIP vision tower and umT5 prompt encoders, on the CPU at realistic shapes (random weights).

    python benchmarks/bench_encoders_vision_text.py [--prompts 300] [--replay-model small|base] [--images 20]
        [--guard-prompts 20] [--repeats 7] [--threads N] [--data PATH]

1. Hit latency (digest + lookup + gather; for text also clean + tokenize + zero padding) as a share of the encoder
   forward alone: CLIP ViT-B/16 at 224 px, umT5-base at 226 and 512 tokens. Target < 1%.
2. Overhead guard: an all-miss stream (distinct images, distinct prompts), per-item latency with the store on vs off,
   measured in pairs (alternating order) on the same inputs, plus the store's own work timed alone (digest, miss
   lookup, put). Target < 1% added.
3. DiffusionDB replay: the first N prompts in order, each with a fixed CFG negative prompt (Wan's default), umT5 at
   512 tokens: text-encoder time per request with the store on vs off, hit rate, every output checked equal to the
   uncached one. Target >= 50% of the text-encoder time saved.

Every model is built from its config with random weights, saved with save_pretrained and loaded back with
from_pretrained. The tokenizer is a real 32k SentencePiece vocabulary (Mistral's v3, shipped with mistral_common)
turned into a byte-fallback BPE without protobuf; it tokenizes exactly as SentencePiece does and never merges two
different prompts into one id sequence, so the hit rate is that of the text.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from encoders.text import CachedPromptEncoder  # noqa: E402
from encoders.vision import CachedVisionEncoder  # noqa: E402
from mmcache.encoder_store import EncoderStore  # noqa: E402
from workloads.fixtures import t5_style_tokenizer  # noqa: E402
from workloads.registry import data_place  # noqa: E402

WAN_NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，"
                "最差质量，低质量，JPEG压缩残留，"
                "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，"
                "静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")
UMT5 = {"base": dict(d_model=768, d_ff=2048, num_layers=12, num_heads=12, d_kv=64),
        "small": dict(d_model=512, d_ff=1024, num_layers=8, num_heads=6, d_kv=64)}  # google/umt5-{base,small}


def median_s(fn, repeats: int) -> float:
    """Median seconds per call over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired(off, on, items) -> tuple[float, float]:
    """Total seconds of ``off(x)`` and ``on(x)`` over ``items``, each pair run back to back, the order alternating so
    drift in the machine's speed falls on both sides alike."""
    totals = [0.0, 0.0]
    for i, x in enumerate(items):
        for side in ((0, 1) if i % 2 else (1, 0)):
            t = time.perf_counter()
            (off, on)[side](x)
            totals[side] += time.perf_counter() - t
    return totals[0], totals[1]


def guard(name: str, items: list, off, on, out_of, on_call=None) -> None:
    """Print one all-miss row: ``off(x)`` vs ``on_call(x)`` (default ``on(x)``) in pairs over distinct ``items``,
    and the store's own work timed alone (key, i.e. digest; a miss lookup; the put of ``out_of(x)``)."""
    t_off, t_on = paired(off, on_call or on, items)
    assert on.store.stats().totals.hits == 0, "items must be distinct"
    outputs, scratch = [out_of(x) for x in items], EncoderStore(1 << 30)
    t = time.perf_counter()
    for x, out in zip(items, outputs):
        key = on.key(x)
        assert scratch.get(key) is None
        scratch.put(key, out)
    work = time.perf_counter() - t
    print(row([name, f"{t_off / len(items) * 1e3:.1f}", f"{t_on / len(items) * 1e3:.1f}",
               f"{(t_on - t_off) / t_off:+.2%}", f"{work / t_off:.3%}"]))


def images(data: Path, n: int) -> list[bytes]:
    """The MMMU PNGs (real, up to 1400 px) when present, then photo-like synthetic 640x480 PNGs up to ``n``."""
    found = [p.read_bytes() for p in sorted((data / "mmmu" / "images").glob("*.png"))][:n]
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:480, 0:640] / 640
    while len(found) < n:
        rgb = np.stack([x, y, (x + y) / 2], -1) * rng.uniform(50, 250, 3) + rng.normal(0, 6, (480, 640, 3))
        buf = io.BytesIO()
        Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(buf, format="PNG")
        found.append(buf.getvalue())
    return found


def umt5(size: str, folder: Path):
    from transformers import UMT5Config, UMT5EncoderModel
    torch.manual_seed(0)
    UMT5EncoderModel(UMT5Config(vocab_size=256384, **UMT5[size])).save_pretrained(folder)
    return UMT5EncoderModel.from_pretrained(folder).eval()


def row(cells, widths=(40, 12, 12, 12, 12)) -> str:
    return "".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))


def run(args, tmp: Path) -> None:
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, store page 64 KiB\n")

    # -- 1. hit latency ------------------------------------------------------------------------------------------
    print("1. hit latency vs the encoder forward alone (median of", args.repeats, "calls)")
    print(row(["encoder", "forward ms", "uncached ms", "hit ms", "hit/forward"]))
    torch.manual_seed(0)
    CLIPVisionModel(CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                     num_attention_heads=12, patch_size=16, image_size=224)).save_pretrained(tmp / "c")
    CLIPImageProcessorPil().save_pretrained(tmp / "c")  # openai/clip-vit-base-patch16 settings: 224 px crop
    clip, proc = CLIPVisionModel.from_pretrained(tmp / "c").eval(), CLIPImageProcessorPil.from_pretrained(tmp / "c")
    pics = images(args.data, args.images)
    vision = CachedVisionEncoder(clip, proc, EncoderStore(1 << 30))
    uncached_vision = CachedVisionEncoder(clip, proc, None, fingerprint=vision.fingerprint)
    pixels = proc(images=Image.open(io.BytesIO(pics[0])), return_tensors="pt").pixel_values
    with torch.inference_mode():
        forward = median_s(lambda: clip(pixel_values=pixels), args.repeats)
    uncached = median_s(lambda: uncached_vision(pics[0]), args.repeats)
    hit = median_s(lambda: vision(pics[0]), args.repeats * 20)
    print(row([f"CLIP ViT-B/16 224px ({len(pics[0]) >> 10} KiB PNG)", f"{forward * 1e3:.1f}",
               f"{uncached * 1e3:.1f}", f"{hit * 1e3:.3f}", f"{hit / forward:.3%}"]))

    tokenizer = t5_style_tokenizer(tmp / "tokenizer")
    prompts = [json.loads(line)["prompt"] for line in open(args.data / "diffusiondb" / "diffusiondb_5k.jsonl")]
    base = umt5("base", tmp / "umt5-base")
    fingerprint = None
    for length in (226, 512):  # the loop leaves the 512-token wrappers for section 2
        text = CachedPromptEncoder(tokenizer, base, EncoderStore(1 << 30), max_sequence_length=length,
                                   fingerprint=fingerprint)
        fingerprint = text.fingerprint  # hashed once: 1.1 GB of weights
        uncached_text = CachedPromptEncoder(tokenizer, base, None, max_sequence_length=length, fingerprint=fingerprint)
        ids, mask = text.tokenize(prompts[0])
        with torch.inference_mode():
            forward = median_s(lambda: base(ids, mask), args.repeats)
        uncached = median_s(lambda: uncached_text.encode(prompts[0]), args.repeats)
        hit = median_s(lambda: text.encode(prompts[0]), args.repeats * 20)
        print(row([f"umT5-base, {length} tokens", f"{forward * 1e3:.1f}", f"{uncached * 1e3:.1f}",
                   f"{hit * 1e3:.3f}", f"{hit / forward:.3%}"]))

    # -- 2. overhead guard ---------------------------------------------------------------------------------------
    print("\n2. overhead guard: all-miss streams, store on vs off, pairs in alternating order")
    print(row(["stream", "off ms/item", "on ms/item", "added", "store work"]))
    on_vision = CachedVisionEncoder(clip, proc, EncoderStore(1 << 30), fingerprint=vision.fingerprint)
    guard(f"{len(pics)} distinct images, CLIP", pics, uncached_vision, on_vision, uncached_vision)
    on_text = CachedPromptEncoder(tokenizer, base, EncoderStore(1 << 30), max_sequence_length=512,
                                  fingerprint=fingerprint)
    guard(f"{args.guard_prompts} distinct prompts, umT5-base 512", list(dict.fromkeys(prompts))[:args.guard_prompts],
          uncached_text.encode, on_text, lambda p: on_text.compute(on_text.tokenize(p)), on_text.encode)

    # -- 3. DiffusionDB replay -----------------------------------------------------------------------------------
    model = umt5(args.replay_model, tmp / f"umt5-{args.replay_model}")
    store = EncoderStore(1 << 30)
    on = CachedPromptEncoder(tokenizer, model, store, max_sequence_length=512)
    off = CachedPromptEncoder(tokenizer, model, None, max_sequence_length=512, fingerprint=on.fingerprint)
    requests = prompts[:args.prompts]
    times = {"off": 0.0, "on": 0.0}
    exact = True
    for i, prompt in enumerate(requests):
        got = {}
        for side in (("off", "on") if i % 2 else ("on", "off")):
            t = time.perf_counter()
            got[side] = (off if side == "off" else on).encode_prompt(prompt, WAN_NEGATIVE)
            times[side] += time.perf_counter() - t
        exact &= all(torch.equal(a, b) for a, b in zip(got["on"], got["off"]))
    stats = store.stats().to_dict()
    n = len(requests)
    print(f"\n3. DiffusionDB replay: first {n} prompts in order + Wan's default negative prompt, "
          f"umT5-{args.replay_model} at 512 tokens, one prompt per forward")
    print(row(["", "off", "on", "saved"], (40, 12, 12, 12)))
    print(row(["text-encoder ms / request", f"{times['off'] / n * 1e3:.1f}", f"{times['on'] / n * 1e3:.1f}",
               f"{1 - times['on'] / times['off']:.1%}"], (40, 12, 12, 12)))
    print(f"encodes {stats['queries']} (prompt + negative per request), hits {stats['hits']} "
          f"({stats['hits'] / stats['queries']:.1%}); distinct prompts {len(set(requests))}; "
          f"store {stats['bytes_stored'] / 2**20:.1f} MiB in {stats['entries']} entries; "
          f"on == off bit for bit: {exact}")
    print("\ntargets: hit/forward < 1%; all-miss added < 1% (store work column: the store's own share, free of the "
          "pairing noise); replay saved >= 50%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=300, help="DiffusionDB requests to replay")
    ap.add_argument("--replay-model", choices=sorted(UMT5), default="small")
    ap.add_argument("--images", type=int, default=20, help="distinct images in the all-miss stream")
    ap.add_argument("--guard-prompts", type=int, default=20, help="distinct prompts in the all-miss stream")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch intra-op threads; 1 on a CPU shared with other jobs, where a parallel op waits out "
                         "the scheduler for a descheduled thread (about 100 ms)")
    ap.add_argument("--data", type=Path, default=data_place()[0])
    args = ap.parse_args()
    if not (prompts := args.data / "diffusiondb" / "diffusiondb_5k.jsonl").is_file():
        sys.exit(f"bench_encoders_vision_text: no DiffusionDB prompts at {prompts}: run `mmcache data fetch "
                 "diffusiondb` (a source made by hand: it says how) or pass --data PATH")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_encoders_") as tmp:  # ~2.5 GB of saved weights
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
