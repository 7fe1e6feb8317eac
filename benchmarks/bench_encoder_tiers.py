"""Encoder outputs shared across instances through a real Mooncake Store (a master started here on loopback): each
figure against a baseline from the same run, as a ratio, with the spread over runs (median [min-max]).

Instance A is another process (its own pool, EncoderStore and Mooncake client): it serves its users' requests and
publishes what it encodes. Instance B is this process, run twice per repeat from an empty device store, in
alternating order: with the shared store under its EncoderStore, and without it (the baseline: B's encoder runs for
every image it has not seen itself). Both sides of B use their own device store, so repeats on B hit either way.

1. Vision: an MMMU-shaped stream (the MMMU-Pro sample questions with their real images, several users per image:
   users split between A and B; ``<data>/mmmu``, or when absent an embedded default of generated images and
   questions, said so), through ``CachedVisionEncoder`` on a CLIP ViT-B/16 tower at 224 px with random weights:
   B's vision seconds, forwards and shared-store hits; every output of B with the store equal to B's own encode.
2. The Wan/umT5 CFG negative prompt (Wan's default) at 512 tokens, once per request of B: B's text-encoder seconds.
3. Store reads of encoder entries A published (CLIP-sized, 605 KB; negative-sized; speaker-embedding-sized, 768 B),
   so every object comes from A's segment (another process): batched (``StoreTier.fetch``: ``get_batch``, 16 a call,
   on the reader thread within one deadline) + verify, vs one ``get`` per entry + verify (best of 3 per repeat).

    python benchmarks/bench_encoder_tiers.py [--quick] [--repeats 3] [--users 4] [--umt5 small|base]
        [--data PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the loopback Mooncake master
from benchmarks.bench_encoders_vision_text import UMT5, WAN_NEGATIVE  # noqa: E402
from benchmarks.timing import best  # noqa: E402
from encoders.text import CachedPromptEncoder  # noqa: E402
from encoders.vision import CachedVisionEncoder  # noqa: E402
from mmcache import EncoderKey, EncoderStore  # noqa: E402
from mmcache.tiers import EncoderTiers, StoreTier, encoder_entry, mooncake  # noqa: E402
from mooncake_master import MooncakeMaster  # noqa: E402
from workloads.registry import data_place  # noqa: E402

PAGE = 1 << 16
READ_ENTRIES = 64  # entries of each size section 3 reads


def quiet() -> None:
    """One torch thread (a shared CPU), no progress bars."""
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()


def spread(values) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def row(name, ours, base, unit, ratio) -> None:
    print(f"{name:<52} {spread(ours):>24} {spread(base):>24} {unit:<9} {spread(ratio):>22}")


def header(title, ours, base, ratio) -> None:
    print(f"\n{title}\n{'':<52} {ours:>24} {base:>24} {'unit':<9} {ratio:>22}")


# -------------------------------------------------------------------------------------------------------- workload
def questions(data: Path | None) -> tuple[list[list], str]:
    """Per question its images (paths or bytes): the MMMU-Pro samples when present, else the embedded default."""
    from workloads.models.vlm_chat import embedded_items
    from workloads.traces.mmmu import load_mmmu

    path = None if data is None else data / "mmmu" / "mmmu_pro_tool_sample_questions.jsonl"
    if path is not None and path.is_file():
        qs = [[p for p in parts if isinstance(p, (Path, bytes))] for parts in load_mmmu(path)]
        return qs, f"MMMU-Pro samples ({path}): {len(qs)} questions, {len({q for qs_ in qs for q in qs_})} images"
    qs = [[p for p in parts if isinstance(p, bytes)] for item in embedded_items(0) for parts in item]
    why = "absent" if path is None else f"{path} absent"
    return qs, f"embedded default ({why}): {len(qs)} generated questions, {len({q for x in qs for q in x})} images"


def stream(qs: list[list], users: range) -> list[list]:
    """Each user of ``users`` asks every question, in an order of its own: the images of each request."""
    import random

    out = []
    for u in users:
        order = list(range(len(qs)))
        random.Random(u).shuffle(order)
        out += [qs[i] for i in order]
    return out


def build(folder: Path, umt5_size: str, layers: int) -> None:
    """The vision tower (with its processor) and the umT5 encoder (with the 32k tokenizer), random weights, saved."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from workloads import fixtures

    with fixtures.seeded():
        CLIPVisionModel(CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=layers,
                                         num_attention_heads=12, patch_size=16, image_size=224)
                        ).save_pretrained(folder / "clip")
        CLIPImageProcessorPil().save_pretrained(folder / "clip")  # openai/clip-vit-base-patch16: 224 px crop
        tokenizer = fixtures.t5_style_tokenizer(folder / "umt5")
        UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **UMT5[umt5_size])).save_pretrained(folder / "umt5")


def load(folder: Path) -> tuple:
    """``(tower, image processor, tokenizer, umT5 encoder)`` loaded back with ``from_pretrained``."""
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPVisionModel, UMT5EncoderModel

    clip, umt5 = folder / "clip", folder / "umt5"
    return (CLIPVisionModel.from_pretrained(clip).eval(), AutoImageProcessor.from_pretrained(clip),
            AutoTokenizer.from_pretrained(umt5), UMT5EncoderModel.from_pretrained(umt5).eval())


def wrap(models: tuple, store: EncoderStore) -> tuple[CachedVisionEncoder, CachedPromptEncoder]:
    tower, processor, tokenizer, umt5 = models
    return (CachedVisionEncoder(tower, processor, store),
            CachedPromptEncoder(tokenizer, umt5, store, max_sequence_length=512))


def read_keys(kind: str) -> list[EncoderKey]:
    return [EncoderKey(f"{kind}-{i}".encode().ljust(16, b"."), "bench-read", kind) for i in range(READ_ENTRIES)]


# -------------------------------------------------------------------------------------------------------- instance A
def instance_a(folder: str, rpc: str, metadata: str, requests: list, shapes: dict, done, stop) -> None:
    """Serve A's requests through a shared-store EncoderStore, publish the entries section 3 reads, tell ``done``,
    and keep the objects it put alive (they live in this process's segment) until ``stop``."""
    quiet()
    tier = StoreTier(mooncake.MooncakeClient(rpc, metadata, 1 << 30, 256 << 20), queue_pages=1 << 16)
    store = EncoderStore(256 << 20, PAGE, tiers=EncoderTiers(store=tier))
    vision, text = wrap(load(Path(folder)), store)
    for images in requests:
        for image in images:
            vision(image)
        text(WAN_NEGATIVE)
    g = torch.Generator().manual_seed(0)
    for kind, shape in shapes.items():
        for key in read_keys(kind):
            store.put(key, torch.randn(shape, generator=g))
    tier.flush(120)
    done.put(tier.counters["published_entries"])
    stop.wait()
    tier.close()


# -------------------------------------------------------------------------------------------------------- instance B
def serve_b(vision, text, requests) -> dict:
    """B's requests through its wrappers: vision and text seconds, forwards (a miss on every tier), outputs."""
    out = {"vision_s": 0.0, "text_s": 0.0, "outputs": [], "sources": []}
    for images in requests:
        t = time.perf_counter()
        got = [vision.lookup(image) for image in images]
        out["vision_s"] += time.perf_counter() - t
        t = time.perf_counter()
        neg = text.lookup(WAN_NEGATIVE)
        out["text_s"] += time.perf_counter() - t
        out["outputs"] += [g.value for g in got] + [neg.value]
        out["sources"] += [g.source for g in got] + [neg.source]
    return out


def run(args, tmp: Path) -> None:
    why = mooncake.available()
    if why:
        print(f"skipped: {why}")
        return
    qs, source = questions(args.data)
    half = args.users // 2
    a_requests, b_requests = stream(qs, range(half)), stream(qs, range(half, args.users))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s); {source}; {args.users} users per "
          f"question, {half} on A and {args.users - half} on B; median [min-max] over {args.repeats} repeats")
    layers = 4 if args.quick else 12
    build(tmp, args.umt5, layers)
    models = load(tmp)
    plain = wrap(models, EncoderStore(256 << 20, PAGE))
    rows = int(plain[1].tokenize(WAN_NEGATIVE)[1].sum())
    shapes = {"clip": (197, 768), "negative": (rows, UMT5[args.umt5]["d_model"]), "speaker": (1, 192)}
    with MooncakeMaster() as master:
        ctx = mp.get_context("spawn")
        done, stop = ctx.Queue(), ctx.Event()
        a = ctx.Process(target=instance_a, args=(str(tmp), master.rpc_address, master.metadata_url,
                                                 [[bytes(p) if isinstance(p, bytes) else str(p) for p in r]
                                                  for r in a_requests], shapes, done, stop))
        a.start()
        client = tier = None
        try:
            published = done.get(timeout=1800)
            client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 1 << 30, 256 << 20)
            tier = StoreTier(client, deadline_s=5.0)  # generous: these figures are throughput, not the fault bound
            shared = wrap(models, EncoderStore(256 << 20, PAGE, tiers=EncoderTiers(store=tier)))
            runs = {"vision": ([], []), "text": ([], [])}
            forwards, hits, exact = [], [], True
            for rep in range(args.repeats):
                got = {}
                for side in (("on", "off") if rep % 2 else ("off", "on")):
                    vision, text = shared if side == "on" else plain
                    vision.store.clear()
                    got[side] = serve_b(vision, text, b_requests)
                runs["vision"][0].append(got["on"]["vision_s"])
                runs["vision"][1].append(got["off"]["vision_s"])
                runs["text"][0].append(got["on"]["text_s"])
                runs["text"][1].append(got["off"]["text_s"])
                forwards.append((got["on"]["sources"].count("computed"), got["off"]["sources"].count("computed")))
                hits.append(got["on"]["sources"].count("shared"))
                exact &= all(torch.equal(x, y) for x, y in zip(got["on"]["outputs"], got["off"]["outputs"]))
            n_img = sum(len(r) for r in b_requests)
            header(f"1./2. instance B: {len(b_requests)} requests, {n_img} images, one negative each; A published "
                   f"{published} entries", "B, shared store", "B alone (baseline)", "saved (1 - on/off)")
            for what, (on, off) in runs.items():
                label = f"vision seconds (CLIP ViT-B/16 {layers} layers, 224 px)" if what == "vision" else \
                    f"text encoder seconds (umT5-{args.umt5}, 512 tokens)"
                row(label, on, off, "s", [1 - a / b for a, b in zip(on, off)])
            per_hit = [t / h for t, h in zip(runs["vision"][0], hits)]
            print(f"B's vision seconds per image with the store: {spread([t / n_img * 1e3 for t in runs['vision'][0]])}"
                  f" ms (shared-store hits, device hits and digests; {spread([t * 1e3 for t in per_hit])} ms per "
                  f"shared-store hit at most)")
            print(f"encoder forwards on B (images + negatives): with the store {forwards[0][0]}, alone "
                  f"{forwards[0][1]}; shared-store hits {spread(hits)}; outputs with the store == B's own encode, "
                  f"bit for bit: {exact}")

            header(f"3. store reads of {READ_ENTRIES} entries A published, verified", "batched entries/s",
                   "one get each entries/s", "batched/one-by-one")
            for kind, shape in shapes.items():
                keys = read_keys(kind)
                names = [encoder_entry.entry_key(k) for k in keys]
                def batched():
                    assert all(not isinstance(encoder_entry.decode(p, k), str)
                               for p, k in zip(tier.fetch(names), keys)), tier.counters

                def one_by_one():
                    assert all(not isinstance(encoder_entry.decode(client.get(n), k), str)
                               for n, k in zip(names, keys))
                ours = [READ_ENTRIES / best(batched, 3) for _ in range(args.repeats)]
                base = [READ_ENTRIES / best(one_by_one, 3) for _ in range(args.repeats)]
                nbytes = 4 * shape[0] * shape[1]
                row(f"{kind} entries {tuple(shape)} float32 ({nbytes / 1e3:.0f} KB)", ours, base, "entries/s",
                    [x / y for x, y in zip(ours, base)])
        finally:
            stop.set()
            a.join(60)
            if tier is not None:
                tier.close()
            if client is not None:
                client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 4-layer tower, 2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--users", type=int, default=4, help="users per question, half of them on instance A")
    ap.add_argument("--umt5", choices=sorted(UMT5), default="small")
    ap.add_argument("--data", type=Path, default=data_place()[0])
    args = ap.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 3)
    if not args.data.is_dir():
        args.data = None
    quiet()
    with tempfile.TemporaryDirectory(prefix="bench_encoder_tiers_") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
