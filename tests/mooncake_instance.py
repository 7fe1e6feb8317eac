"""One serving instance in its own process, for the cross-instance tests: load the tiny Llama saved in ARGV[1], put a
Mooncake Store tier (master ARGV[2], metadata ARGV[3]) under a fresh device pool, serve the prompt read as JSON
from stdin with one-page chunks, wait until its pages are published, print the output ids, and stay up (its memory
holds the objects it put) until stdin closes."""

import json
import sys

import torch
from transformers import LlamaForCausalLM

from mmcache.hf.paged_kv import PagedKVCache
from mmcache.hf.runner import serve
from mmcache.tiers import StoreTier, TierStack
from mmcache.tiers.mooncake import MooncakeClient


def main() -> None:
    torch.set_num_threads(1)
    folder, rpc, metadata = sys.argv[1:4]
    request = json.loads(sys.stdin.readline())
    model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    store = StoreTier(MooncakeClient(rpc, metadata, 64 << 20, 32 << 20))
    P = request["page_size"]
    kv = PagedKVCache.for_model(model, num_pages=32, page_size=P,
                                tiers=TierStack(PagedKVCache.fingerprint_for(model, P), store=store))
    got = serve(model, kv, "a", request["prompt"], max_new_tokens=request["new"], chunk_tokens=request["page_size"])
    store.flush(30)
    print(json.dumps({"output_ids": got.output_ids, "published": store.counters["published_pages"]}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
