"""One serving instance's encoders in their own process, for the cross-instance encoder test: load the tiny CLIP
tower saved in ARGV[1] and the umT5 text encoder (with its tokenizer) saved in ARGV[2], put an EncoderStore with a
Mooncake Store tier (master ARGV[3], metadata ARGV[4]) on a fresh pool of this process, encode the images and the
negative prompt of the request read as JSON from stdin, wait until the entries are published, save the outputs to
ARGV[5] (torch.save), print the lookup sources, and stay up (its memory holds the objects it put) until stdin
closes."""

import json
import sys

import torch
from transformers import AutoImageProcessor, AutoTokenizer, CLIPVisionModel, UMT5EncoderModel

from encoders.text import CachedPromptEncoder
from encoders.vision import CachedVisionEncoder
from mmcache import EncoderStore
from mmcache.tiers import EncoderTiers, StoreTier
from mmcache.tiers.mooncake import MooncakeClient


def main() -> None:
    torch.set_num_threads(1)
    vision_folder, text_folder, rpc, metadata, out = sys.argv[1:6]
    request = json.loads(sys.stdin.readline())
    tower = CLIPVisionModel.from_pretrained(vision_folder).eval()
    processor = AutoImageProcessor.from_pretrained(vision_folder)
    umt5 = UMT5EncoderModel.from_pretrained(text_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    store_tier = StoreTier(MooncakeClient(rpc, metadata, 64 << 20, 32 << 20))
    store = EncoderStore(1 << 20, 4096, tiers=EncoderTiers(store=store_tier))
    vision = CachedVisionEncoder(tower, processor, store)
    text = CachedPromptEncoder(tokenizer, umt5, store, max_sequence_length=request["max_length"])
    images = [vision.lookup(path) for path in request["images"]]
    negative = text.lookup(request["negative"])
    store_tier.flush(30)
    torch.save({"images": [f.value for f in images], "negative": negative.value}, out)
    print(json.dumps({"sources": [f.source for f in images] + [negative.source],
                      "published": store_tier.counters["published_entries"]}), flush=True)
    sys.stdin.read()
    store_tier.close()


if __name__ == "__main__":
    main()
