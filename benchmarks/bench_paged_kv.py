"""Pool-backed KV in real transformers models: time to first token with reuse on and off, and the decode step cost.

- Text chat: MT-Bench two-turn questions (mt-bench/ in the data folder the replays read, which mmcache data fetch
  mt-bench fills; else generated text)
  behind a fixed system prompt, Mistral v3 chat template and tokenizer, on a random-weight Llama (hidden 512,
  8 layers, GQA 8/4, vocab 32768).
- VLM chat: MMMU-Pro questions with their images (mmmu/ in the same folder; else random images) and two follow-up
  turns on the same image, on a random-weight LLaVA (CLIP ViT 224/14: 256 placeholders per image, + the same Llama).
Each row names the data it ran on ("embedded default: ..." when the data is absent).
- Decode: per-step time at a ~1k-token context, PagedKVCache against transformers' DynamicCache.

Reuse on: ``PagedKVCache`` + ``EncoderStore`` (``runner.serve``). Reuse off: ``DynamicCache`` and the vision tower on
every image, the same prefill chunks from position 0 (``runner.replay``). Both run on the same model in the same
process, request by request; the next turn's history is the reuse-on run's output. TTFT counts from arrival
(digests, admission, encoders, prefill) to the first token.

Run: python benchmarks/bench_paged_kv.py [--conversations 10] [--vlm-questions 14] [--threads 1]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from encoders.llava import LlavaPrefill  # noqa: E402
from mmcache.encoder_store import EncoderStore  # noqa: E402
from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape  # noqa: E402
from mmcache.hf.runner import chunk_spans, replay, serve  # noqa: E402
from workloads import registry  # noqa: E402
from workloads.traces.tokenizer import load_tokenizer  # noqa: E402

BOS, INST, END_INST, EOS, IMG = 1, 3, 4, 2, 10  # Mistral v3 control tokens
SYSTEM = ("You are a helpful, knowledgeable assistant. Answer the user's questions accurately and concisely, "
          "explain your reasoning when it helps, and say so when you are unsure.")
FOLLOW_UPS = ("Explain your reasoning step by step.", "Which details in the image support that answer?")


def data_dir() -> Path:
    """The data folder the replays read (``registry.data_place``: $MMCACHE_DATA, else what mmcache data fetch fills)."""
    return registry.data_place()[0]


def text_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)


def load(model, folder: Path, attn: str):
    """``model`` saved and loaded back with ``attn`` attention, in eval mode (random weights, built from config)."""
    model.save_pretrained(folder)
    return type(model).from_pretrained(folder, attn_implementation=attn).eval()


def mt_bench_questions(n: int) -> tuple[list[list[str]], str]:
    """Two-turn questions and the label of the data they are: MT-Bench, or generated text when it is absent."""
    path = data_dir() / "mt-bench" / "question.jsonl"
    if path.is_file():
        return [json.loads(line)["turns"] for line in path.read_text().splitlines()[:n]], "MT-Bench"
    rng = np.random.default_rng(0)
    words = "the of model cache page token image prefix reuse request chat answer question".split()
    return ([[" ".join(rng.choice(words, 40)), " ".join(rng.choice(words, 20))] for _ in range(n)],
            "embedded default: generated text, no MT-Bench data")


def mmmu_questions(n: int) -> tuple[list[list], str]:
    """MMMU-Pro questions as parts in order: text (str) and images (raw file bytes) where the text says
    ``<image N>``, and the label of the data they are; random PNGs stand in when the data is absent."""
    root = data_dir() / "mmmu"
    path = root / "mmmu_pro_tool_sample_questions.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text().splitlines()[:n]:
            q = json.loads(line)
            options = "".join(f"\n{chr(65 + i)}. {o}" for i, o in enumerate(q["options"]))
            text = re.split(r"<image (\d)>", q["question"] + options + "\nAnswer with the option's letter.")
            out.append([(root / q[f"image_{part}"]).read_bytes() if i % 2 else part for i, part in enumerate(text)])
        return out, "MMMU-Pro"
    from PIL import Image
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (336, 448, 3), dtype=np.uint8)).save(buf, "PNG")
        out.append([buf.getvalue(), f"Question {i}: what does the figure show?"])
    return out, "embedded default: random images, no MMMU-Pro data"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def text_chat(model, tok, args, rows) -> None:
    kv = PagedKVCache.for_model(model, num_pages=4096, page_size=args.page_size)
    system = [BOS, INST, *tok.encode(SYSTEM + "\n\n")]
    per_turn = {}
    questions, data = mt_bench_questions(args.conversations)
    for c, turns in enumerate(questions):
        history = []
        for t, question in enumerate(turns):
            prompt = (system if t == 0 else history + [INST]) + tok.encode(question) + [END_INST]
            on = serve(model, kv, f"mt{c}.{t}", prompt, max_new_tokens=args.new_tokens, chunk_tokens=args.chunk)
            off = replay(model, DynamicCache(config=model.config), prompt, chunk_spans(0, len(prompt), args.chunk),
                         max_new_tokens=1)
            per_turn.setdefault(t, []).append((len(prompt), on.matched_tokens, off.ttft_s, on.ttft_s))
            history = prompt + on.output_ids + [EOS]
    report(rows, f"text chat ({data})", per_turn)


def vlm_chat(model, tok, args, rows) -> None:
    kv = PagedKVCache.for_model(model, num_pages=8192, page_size=args.page_size)
    processor = CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    chat = LlavaPrefill(model, processor, kv, EncoderStore(256 << 20, 1 << 16))
    plain = LlavaPrefill(model, processor)
    per_turn = {}
    questions, data = mmmu_questions(args.vlm_questions)
    for q, parts in enumerate(questions):
        user = [[tok.encode(p) if isinstance(p, str) else p for p in parts]]
        user += [[tok.encode(follow_up)] for follow_up in FOLLOW_UPS]
        history = chat.prompt([BOS])
        for t, message in enumerate(user):
            prompt = chat.prompt(history, [INST], *message, [END_INST])
            on = chat.serve(f"mmmu{q}.{t}", prompt, max_new_tokens=args.vlm_new_tokens, chunk_tokens=args.chunk)
            n = len(prompt.token_ids)
            arrival = time.perf_counter()  # the uncached tower runs inside the timed span, as the cached run's does
            off = replay(model, DynamicCache(config=model.config), prompt.token_ids, chunk_spans(0, n, args.chunk),
                         max_new_tokens=1, embed=plain.embedder(prompt), arrival=arrival)
            per_turn.setdefault(t, []).append((n, on.matched_tokens, off.ttft_s, on.ttft_s))
            history = chat.prompt(prompt, on.output_ids, [EOS])
    report(rows, f"VLM chat ({data}, same image)", per_turn)


def report(rows, name: str, per_turn: dict) -> None:
    everything = [r for runs in per_turn.values() for r in runs]
    if not everything:
        return
    for label, runs in [*((f"turn {t + 1}", runs) for t, runs in per_turn.items()), ("all turns", everything)]:
        n, m, off, on = (np.array(x, dtype=float) for x in zip(*runs))
        rows.append((f"{name}, {label}", f"{len(runs)}", f"{n.mean():,.0f}", f"{m.sum() / n.sum():.1%}",
                     ms(np.median(off)), ms(np.median(on)), f"{off.sum() / on.sum():,.2f}x"))


def alternate(steps: int, fns) -> list[list[float]]:
    """Wall times of ``steps`` calls of each of ``fns``, alternating call by call (order flipped every step), so load
    from other processes falls on all alike."""
    times = [[] for _ in fns]
    for i in range(steps):
        for j in (range(len(fns)) if i % 2 else reversed(range(len(fns)))):
            t0 = time.perf_counter()
            fns[j]()
            times[j].append(time.perf_counter() - t0)
    return times


def model_step(model, cache, prompt: list[int], chunk: int):
    """Prefill ``prompt`` into ``cache``; returns one greedy decode step on it."""
    replay(model, cache, prompt, chunk_spans(cache.get_seq_length(), len(prompt), chunk))
    tok = [torch.tensor([[prompt[-1]]])]

    def step():
        tok[0] = model(input_ids=tok[0], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    return step


def update_step(cache, heads: int, dim: int, context: int):
    """Fill every layer of ``cache`` with ``context`` positions; returns one decode step's ``cache.update`` calls over
    all layers: the cache's own work in a step, without the model."""
    step_kv = torch.randn(1, heads, 1, dim)
    for layer in range(len(cache.layers)):
        cache.update(torch.randn(1, heads, context, dim), torch.randn(1, heads, context, dim), layer)

    def step():
        for layer in range(len(cache.layers)):
            cache.update(step_kv, step_kv, layer)
    return step


@torch.inference_mode()
def decode(model, args, rows) -> None:
    rng = np.random.default_rng(1)
    _, _, _, heads, dim = kv_page_shape(model.config, args.page_size)
    for context in args.contexts:
        kv = PagedKVCache.for_model(model, num_pages=(context + args.steps) // args.page_size + 8,
                                    page_size=args.page_size)
        runs = {"decode step": ([], []), "  its cache updates alone (all layers, no model)": ([], [])}
        for r in range(args.rounds):
            prompt = rng.integers(11, 32768, context).tolist()
            for (label, (dyn, paged)), make in zip(runs.items(), (
                    lambda cache: model_step(model, cache, prompt, args.chunk),
                    lambda cache: update_step(cache, heads, dim, context))):
                kv.admit(r, prompt)
                d, p = alternate(args.steps, [make(DynamicCache(config=model.config)), make(kv)])
                kv.abort(r)
                dyn += d
                paged += p
        for label, (dyn, paged) in runs.items():
            d, p = statistics.median(dyn), statistics.median(paged)
            rows.append((f"{label}, {context:,}-token context", f"{len(dyn)}", f"{d * 1e3:,.3f}", f"{p * 1e3:,.3f}",
                         f"{p / d - 1:+.1%}"))


def table(head: tuple, rows: list) -> None:
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    for r in (head, tuple("-" * w for w in widths), *rows):
        print("| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                for i, (c, w) in enumerate(zip(r, widths))) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=10, help="MT-Bench questions (two turns each)")
    ap.add_argument("--vlm-questions", type=int, default=14, help="MMMU-Pro questions (three turns each)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per text turn")
    ap.add_argument("--vlm-new-tokens", type=int, default=32, help="tokens generated per VLM turn")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (a multiple of the page size)")
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024])
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = load_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        llama = load(LlamaForCausalLM(text_config()), Path(tmp) / "llama", args.attn)
        llava = load(LlavaForConditionalGeneration(LlavaConfig(
            vision_config=CLIPVisionConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                                           num_attention_heads=8, image_size=224, patch_size=14),
            text_config=text_config(), image_token_id=IMG)), Path(tmp) / "llava", args.attn)
    warm = [BOS, *range(100, 300)]
    for model in (llama, llava):  # first calls pay one-time kernel and allocator setup
        replay(model, DynamicCache(config=model.config), warm, chunk_spans(0, len(warm), args.chunk), max_new_tokens=2)
    ttft, steps = [], []
    text_chat(llama, tok, args, ttft)
    vlm_chat(llava, tok, args, ttft)
    decode(llama, args, steps)
    print(f"{args.attn}, float32, {args.threads} thread(s), page size {args.page_size}, prefill chunk {args.chunk}; "
          f"data folder {data_dir()} (the one the replays read)\n")
    print("Time to first token, median per request; off/on: total TTFT with reuse off / on")
    table(("workload", "requests", "prompt tokens", "matched", "reuse off ms", "reuse on ms", "off/on"), ttft)
    print("\nDecode, median per step; DynamicCache and PagedKVCache alternate step by step")
    table(("figure", "steps", "DynamicCache ms", "PagedKVCache ms", "PagedKVCache vs DynamicCache"), steps)

if __name__ == "__main__":
    main()
