"""Runs inside vLLM's own virtual environment (never the main one): serves the requests of a JSON spec through vLLM's
``LLMEngine`` with automatic prefix caching, in order, at most ``inflight`` at once, a call only after its session's
previous call finished (as ``workloads.peers.transformers_cb.PeerEngine.replay``), and prints one JSON line:
per call the generated ids, the prompt tokens vLLM served from its cache (``num_cached_tokens``) and the time to first
token; the wall time; vLLM's version. Driven by ``benchmarks/bench_vllm.py``.

Spec: {"model", "block_size", "num_blocks", "inflight", "batch_tokens", "new_tokens", "share", "calls":
[{"rid", "session", "token_ids"}]}
"""

import collections
import json
import sys
import time

RESULT = "VLLM_RESULT "  # marks the result line: vLLM logs to stdout too


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    import vllm
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(c["token_ids"]) for c in spec["calls"]) + spec["new_tokens"]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=spec["model"], skip_tokenizer_init=True, dtype="float32", block_size=spec["block_size"],
        enable_prefix_caching=spec["share"], num_gpu_blocks_override=spec["num_blocks"],
        max_num_seqs=spec["inflight"], max_num_batched_tokens=max(spec["batch_tokens"], longest),
        max_model_len=longest, enforce_eager=True))
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    calls = spec["calls"]
    pending, running, busy, results, first = collections.deque(calls), {}, set(), {}, {}
    started = time.perf_counter()
    submitted = {}
    while pending or running:
        while len(running) < spec["inflight"]:
            nxt = next((c for c in pending if c["session"] not in busy), None)
            if nxt is None:
                break
            pending.remove(nxt)
            submitted[nxt["rid"]] = time.perf_counter()
            engine.add_request(nxt["rid"], TokensPrompt(prompt_token_ids=nxt["token_ids"]), params)
            running[nxt["rid"]] = nxt
            busy.add(nxt["session"])
        for out in engine.step():
            rid = out.request_id
            if out.outputs and out.outputs[0].token_ids and rid not in first:
                first[rid] = time.perf_counter() - submitted[rid]
            if out.finished:
                call = running.pop(rid)
                busy.discard(call["session"])
                results[rid] = {"rid": rid, "output_ids": list(out.outputs[0].token_ids),
                                "matched_tokens": int(out.num_cached_tokens or 0), "ttft_s": first[rid]}
    wall = time.perf_counter() - started
    doc = {"vllm": vllm.__version__, "wall_s": wall, "outcomes": [results[c["rid"]] for c in calls]}
    print(RESULT + json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
