"""Video paths with the encoder store on vs off, on the CPU, tiny models built from configs (random weights).

    python benchmarks/bench_video.py [--videos 24] [--repeats 5] [--threads 1] [--data [PATH]]

1. Overhead guard, all-miss: distinct prompts and distinct conditioning images (video-gen) or
   distinct clips (video-chat), each video served with a fresh store (nothing can hit) and without one, in pairs
   on the same input, alternating which goes first. Per-video latency off and on, their ratio (median, p10-p90
   over the pairs), and the store's own work as a share of a video's time, in two parts: keying (read, tokenize,
   digest: the tokenizing the uncached encoder does too) and store ops (miss lookup, put, gather, with the encoder
   replaced by an output already computed). Target: ratio within noise, store ops < 0.5%.
2. Hit cost against the encoder it skips: best-of-``repeats`` time of a store hit vs the uncached encoder, for the
   umT5 prompt (512 tokens), the conditioning image's VAE latents and a clip's video features.
3. Video-chat TTFT per turn, cache off vs on, on the clips of ``--data`` (MMMU; ``--data`` alone: the data folder the
   replays read, ``workloads.registry.data_place``) or the embedded ones (median ms).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import best  # noqa: E402
from mmcache.encoder_store import EncoderStore  # noqa: E402
from workloads.harness.serving import Clock, Schedule, compare  # noqa: E402
from workloads.models import image_gen, video_chat, video_gen, vlm_chat  # noqa: E402
from workloads.models.vlm_chat import generated_png  # noqa: E402
from workloads.options import ModelWorkloadOptions  # noqa: E402
from workloads.registry import data_place  # noqa: E402
from workloads.traces.clips import pan_clip  # noqa: E402


def spread(xs) -> str:
    q = np.percentile(xs, [10, 50, 90])
    return f"{q[1]:.4f} ({q[0]:.4f}-{q[2]:.4f})"


def paired(run_off, run_on, n: int) -> tuple[list[float], list[float]]:
    """Seconds per item off and on, served in pairs on item k, alternating which goes first."""
    off, on = [], []
    for k in range(n):
        for which in ((0, 1) if k % 2 else (1, 0)):
            t = time.perf_counter()
            (run_off if which == 0 else run_on)(k)
            (off if which == 0 else on).append(time.perf_counter() - t)
    return off, on


def row(name: str, off: list[float], on: list[float], keying_s: float, store_s: float) -> str:
    ratio = [b / a for a, b in zip(off, on)]
    med = statistics.median(off)
    return (f"| {name} | {len(off)} | {1000 * med:.1f} | {1000 * statistics.median(on):.1f} | {spread(ratio)} | "
            f"{1000 * keying_s:.3f} ({keying_s / med:.2%}) | {1000 * store_s:.3f} ({store_s / med:.2%}) |")


def video_gen_guard(options: ModelWorkloadOptions, n: int) -> str:
    """All-miss video-gen: even items text-to-video, odd ones image-to-video, every prompt, negative and image new."""
    make = video_gen.factory(options)
    base = make()
    rng = np.random.default_rng(1)
    images = [generated_png(k, rng) for k in range(n)]
    clips = [video_gen.Clip(f"a lighthouse number {k} at dusk, oil painting", k, images[k] if k % 2 else None)
             for k in range(n)]
    fresh = [make() for _ in range(n)]  # one empty store per video: every lookup misses
    served = lambda wl, k, cached: wl.generate(clips[k], cached, Clock())  # noqa: E731
    off, on = paired(lambda k: served(base, k, False), lambda k: served(fresh[k], k, True), n)
    # the store's own work per video: the on path's lookups with each encoder replaced by an output already computed
    text, latents = base.encoder.compute(base.encoder.read("x")), base.latents.compute(images[1])
    store = EncoderStore(16 << 20, image_gen.ENCODER_PAGE_BYTES)

    keys = lambda k: [*(base.encoder.key(p) for p in (clips[k].prompt, f"negative {k}")),  # noqa: E731
                      *([base.latents.key(clips[k].image)] if clips[k].image is not None else [])]
    values = lambda k: [text, text, latents][:len(keys(k))]  # noqa: E731
    return row("video-gen (T2V + I2V)", off, on, *store_work(store, keys, values, n))


def video_chat_guard(options: ModelWorkloadOptions, n: int) -> str:
    """All-miss video-chat: one first turn per distinct clip, prefix cache and store fresh per clip."""
    make = video_chat.factory(options)
    base = make()
    rng = np.random.default_rng(2)
    parts = [pan_clip(generated_png(k, rng)) for k in range(n)]
    tok = video_chat.fixtures.text_tokenizer(None)
    question = tok.encode(["\nWhat moves in this clip?\n[assistant]\n"])[0]
    prompts = [base.plain.prompt([tok.bos_id()], clip, question) for clip in parts]
    fresh = [make() for _ in range(n)]
    P = options.page_size
    off, on = paired(lambda k: base.plain.serve(f"o{k}", prompts[k], max_new_tokens=2, chunk_tokens=P,
                                                index_output=False),
                     lambda k: fresh[k].llava.serve(f"n{k}", prompts[k], max_new_tokens=2, chunk_tokens=P,
                                                    index_output=False), n)
    features = base.plain.encoder.compute(parts[0])
    store = EncoderStore(64 << 20, vlm_chat.ENCODER_PAGE_BYTES)
    keys = lambda k: [base.plain.encoder.key(parts[k])]  # noqa: E731
    return row("video-chat (first turn)", off, on, *store_work(store, keys, lambda k: [features], n))


def store_work(store: EncoderStore, keys, values, n: int) -> tuple[float, float]:
    """Seconds per video of ``(keying, store ops)``: reading, tokenizing and digesting the inputs into keys, then
    the miss lookups with their puts and gathers (each encoder replaced by an output already computed)."""
    t = time.perf_counter()
    made = [keys(k) for k in range(n)]
    keyed = time.perf_counter() - t
    outputs = [values(k) for k in range(n)]
    t = time.perf_counter()
    for k in range(n):
        for key, value in zip(made[k], outputs[k]):
            store.get_or_compute(key, lambda: value)
    return keyed / n, (time.perf_counter() - t) / n


def hit_costs(options: ModelWorkloadOptions, repeats: int) -> list[str]:
    wl = video_gen.factory(options)()
    image = generated_png(0, np.random.default_rng(3))
    chat = video_chat.factory(options)()
    clip = pan_clip(image)
    rows = []
    for name, enc, media in (("umT5 prompt (512 tokens)", wl.encoder, "a red fox in the snow, watercolor"),
                             ("image VAE latents", wl.latents, image),
                             ("clip video features", chat.llava.encoder, clip)):
        enc.lookup(media)  # store it
        hit = best(lambda: enc.lookup(media), repeats, 5)
        miss = best(lambda: enc.compute(enc.read(media)), repeats, 2)
        rows.append(f"| {name} | {1000 * hit:.3f} | {1000 * miss:.3f} | {hit / miss:.2%} |")
    return rows


def chat_turns(options: ModelWorkloadOptions) -> list[str]:
    made = []
    make = video_chat.factory(options)
    off, on = compare(lambda: made.append(make()) or made[-1], Schedule.parse("closed:1"))
    rows = []
    for turn in range(1 + len(video_chat.FOLLOW_UPS)):
        med = [1000 * statistics.median(r.token_s[0] for r in run.records if r.ok and r.rid.endswith(f"t{turn}"))
               for run in (off, on)]
        rows.append(f"| {turn + 1} | {med[0]:.1f} | {med[1]:.1f} | {1 - med[1] / med[0]:.0%} |")
    assert made[0].outputs == made[1].outputs
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--videos", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", type=Path, nargs="?", const=data_place()[0],
                    help="the data folder with mmmu/images (alone: the one the replays read)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = ModelWorkloadOptions(encoder_bytes=16 << 20, max_new_tokens=2)
    print("all-miss overhead guard (per video; ratio = on / off per pair, median (p10-p90))\n")
    print("| path | videos | off ms (median) | on ms (median) | ratio on/off | keying ms (of a video) | "
          "store ops ms (of a video) |")
    print("|---|---:|---:|---:|---|---:|---:|")
    print(video_gen_guard(options, args.videos))
    print(video_chat_guard(options, args.videos))
    print("\nhit vs the encoder it skips (best of repeats)\n")
    print("| encoder | hit ms | encoder ms | hit / encoder |\n|---|---:|---:|---:|")
    print("\n".join(hit_costs(options, args.repeats)))
    print(f"\nvideo-chat TTFT per turn ({'--data' if args.data else 'embedded clips'}, closed:1, median ms)\n")
    print("| turn | off | on | saved |\n|---:|---:|---:|---:|")
    chat_options = ModelWorkloadOptions(data=args.data, max_new_tokens=2)
    print("\n".join(chat_turns(chat_options)))


if __name__ == "__main__":
    main()
