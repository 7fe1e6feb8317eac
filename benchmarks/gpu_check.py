"""GPU readiness check (prepared, NOT yet run: no GPU was available when it was written). One GPU, under 5 minutes.

1. Page gather/seed bandwidth on M*'s layout [layers, pages, 2, P, H, D] (a page is a dim-1 slice): copying
   reused pages into fresh ones with one ``index_select``/``index_copy_`` along dim 1 vs a plain device-to-device
   copy of the same bytes, in the same run (ratio; no non-contiguous staging copy is made).
2. Pool devices: a PagePool built on "cuda" accepts K/V on "cuda:0".
3. The bit-exact gate in bf16 on CUDA (sdpa and eager): a tiny Llama (seeded, no hub) served through the runner
   with PagedKVCache on "cuda" (cache on: the second request reuses the first one's pages) vs a DynamicCache replay
   of the same chunk schedule (cache off), every forward's logits compared with ``torch.equal``.
4. M*'s KV resource with reuse on CUDA (needs mstar-ai): a decode step whose pages fill, with the fed ids on the
   device, commits without waiting for the GPU (a 0.2 s GPU spin queued before it; the commit must take far less),
   and its pages are indexed, under the ids fed, at the first commit after the copy landed.
Not in it yet (left): the drop-in under M*'s real FlashInfer path (needs flashinfer installed on the GPU machine).
Without CUDA it exits at once with a message saying so.

    python benchmarks/gpu_check.py
"""

import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bandwidth(layers=32, pages=4096, P=16, H=8, D=128, moved=512, runs=10):
    kv = torch.zeros(layers, pages, 2, P, H, D, dtype=torch.bfloat16, device="cuda")
    src = torch.randperm(pages, device="cuda")[:moved]
    dst = torch.randperm(pages, device="cuda")[:moved]
    flat = torch.empty(layers * moved * 2 * P * H * D, dtype=torch.bfloat16, device="cuda")
    flat_src = torch.randn_like(flat)

    def gather():
        kv.index_copy_(1, dst, kv.index_select(1, src))

    def plain():
        flat.copy_(flat_src)

    out = {}
    for name, fn in (("page gather+seed (dim 1)", gather), ("plain d2d copy", plain)):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(runs):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        out[name] = (min(ts), max(ts) / min(ts))
    nbytes = flat.numel() * flat.element_size()
    base = out["plain d2d copy"][0]
    print(f"{'copy':<28}{'GB/s':>8}{'spread':>8}{'vs plain':>10}")
    for name, (t, spread) in out.items():
        print(f"{name:<28}{nbytes / t / 1e9:>8.1f}{spread:>8.2f}{t / base:>10.2f}")


def devices():
    from mmcache.pool import PagePool, same_device
    pool = PagePool(4, (2, 2), torch.bfloat16, "cuda")
    assert same_device(pool.device, torch.zeros(1, device="cuda:0").device)
    print("PagePool('cuda') accepts tensors on cuda:0: ok")


def gate(P=4, new=5, device="cuda", dtype=torch.bfloat16):
    """Cache on vs off on one chunk schedule, bf16 on CUDA: exits non-zero on the first unequal logits (``device``
    and ``dtype`` only let the logic be tried on a CPU:
    ``python -c "import gpu_check; gpu_check.gate(device='cpu')"``)."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from mmcache.hf.paged_kv import PagedKVCache
    from mmcache.hf.runner import replay, serve
    g = torch.Generator().manual_seed(0)
    system, q1, q2 = (torch.randint(0, 500, (n,), generator=g).tolist() for n in (10, 7, 9))
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
        model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
        kv = PagedKVCache.for_model(model, num_pages=64, page_size=P)
        assert kv.pool.device.type == torch.device(device).type
        first = serve(model, kv, "a", system + q1, max_new_tokens=new)
        second = serve(model, kv, "b", system + q2, max_new_tokens=new)
        assert second.matched_tokens == len(system) // P * P > 0, second.matched_tokens
        # off: the matched prefix recomputed in the chunks the first request computed it in, then b's own chunks
        n = len(system + q2)
        own = [s for s in second.spans if s[1] <= n]  # b's prefill chunks (its decode spans end past n)
        spans = [s for s in first.spans if s[1] <= second.matched_tokens] + own
        off = replay(model, DynamicCache(), system + q2, spans, max_new_tokens=new)
        skipped = len(spans) - len(own)
        ok = off.output_ids == second.output_ids and len(off.logits) - skipped == len(second.logits) and all(
            torch.equal(a, b) for a, b in zip(off.logits[skipped:], second.logits))
        print(f"bit-exact gate, {dtype} on {device}, {attn}: {'ok' if ok else 'FAILED'} "
              f"({second.matched_tokens} tokens reused, {len(second.logits)} forwards compared)")
        if not ok:
            sys.exit(1)


def commit_does_not_wait(requests=64, page=16, prompt=32, device="cuda"):
    """Check 4 (``device`` only lets the logic be tried on a CPU, where ids are joined at once)."""
    from mmcache.mstar.requirement import why_unavailable
    if why_unavailable() is not None:
        print(f"KV resource on {device}: skipped ({why_unavailable()})")
        return
    from mstar.communication.tensors import LocalTransferEngine
    from mstar.engine.resources import KVConfig, KVSpec, KVStep, Segment, StepContext, StepRunner, SubmoduleStep
    from mstar.engine.resources.base import EngineResourceInfo, build_resource
    from mstar.engine.resources.kv.transfer import TransferEngineInfo

    from mmcache.mstar.kv_resource import PrefixReuse, ReuseKVSpec

    pages = requests * 4 + 16
    cfg = KVConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_seq_len=pages * page, max_num_pages=pages,
                   page_size=page)
    spec = ReuseKVSpec.of(KVSpec(resource_key="kv", nodes={"n"}, config=cfg), PrefixReuse(model="gpu-check"))
    info = EngineResourceInfo(device=torch.device(device), kv_dtype=torch.bfloat16,
                              transfer_engine_info=TransferEngineInfo("e", "s", LocalTransferEngine("h")))
    kv = build_resource(spec, info)
    runner = StepRunner({"kv": kv})
    rids = [f"r{i}" for i in range(requests)]

    def run(span):
        s = SubmoduleStep(segments=[Segment(rid, "main", span) for rid in rids], steps={"kv": KVStep()})
        s.set_ctx(StepContext(request_ids=rids, graph_walk="decode", slot=0, capture=False))
        assert runner.admit(s).ok
        runner.plan(s)
        t = time.perf_counter()
        runner.commit(s)
        return time.perf_counter() - t

    for i, rid in enumerate(rids):
        runner.ingest_request(rid)
        kv.feed(rid, "main", torch.arange(prompt) + i * prompt)
    run(prompt)
    cached = kv.stats("main").pages_cached
    tok = torch.tensor([7], device=device)
    for _ in range(page - 1):
        kv.feed_rows("main", {rid: tok for rid in rids})
        run(1)
    kv.feed_rows("main", {rid: tok for rid in rids})
    if device == "cuda":
        torch.cuda._sleep(int(0.2 * torch.cuda.get_device_properties(0).clock_rate * 1e3))  # ~0.2 s of GPU spin
    waited = run(1)  # every stream's third page fills here
    if device == "cuda":
        torch.cuda.synchronize()
    kv.feed_rows("main", {rid: tok for rid in rids})
    run(1)  # the copy has landed: this commit indexes the pages
    indexed = kv.stats("main").pages_cached - cached
    index = kv.lifecycle("main").index
    ids_ok = all((index._tokens[p] == 7).all() for p in np.flatnonzero(index.indexed) if index._depth[p] == 2)
    ok = indexed == requests and ids_ok and (device != "cuda" or waited < 0.05)
    spin = " beside a 200 ms GPU spin" if device == "cuda" else ""
    print(f"KV resource on {device}: the filling step's commit took {waited * 1e3:.1f} ms{spin}; "
          f"{indexed}/{requests} generated pages indexed, ids {'as fed' if ids_ok else 'WRONG'}: "
          f"{'ok' if ok else 'FAILED'}")
    for rid in rids:
        runner.remove_request(rid)
    if not ok:
        sys.exit(1)


def main():
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; nothing was checked (run it on a machine with one GPU)")
    print(torch.cuda.get_device_name(0), torch.__version__)
    bandwidth()
    devices()
    gate()
    commit_does_not_wait()


if __name__ == "__main__":
    main()
