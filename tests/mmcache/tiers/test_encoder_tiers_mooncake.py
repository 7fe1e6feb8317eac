"""Two instances, two processes, one real Mooncake master on 127.0.0.1: instance A (``encoder_instance.py``, its own
pool and EncoderStore) encodes image features with a tiny CLIP tower and the umT5 embedding of a CFG negative
prompt; instance B (this process, its own pool and store) serves both from the shared store without running either
encoder (forward calls counted), bit-equal to A's outputs and to its own uncached encode."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer, CLIPVisionModel, UMT5Config, UMT5EncoderModel

from conftest import png_bytes, save_tiny
from encoders.text import CachedPromptEncoder
from encoders.vision import CachedVisionEncoder
from mmcache import EncoderStore
from mmcache.tiers import EncoderTiers, StoreTier, mooncake
from mooncake_master import MooncakeMaster

WHY = mooncake.available()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"Mooncake Store cannot run here: {WHY}"),
              pytest.mark.usefixtures("one_thread")]
L = 16  # max_sequence_length of the umT5 encode
NEGATIVE = "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny CLIP vision tower with its processor, and a tiny umT5 encoder with a real 32k tokenizer, each built
    from a config with random weights and saved."""
    from transformers import CLIPVisionConfig

    from workloads import fixtures

    vision = save_tiny(tmp_path_factory, "clip-tower", lambda: CLIPVisionModel(CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=8,
        image_size=32)), fixtures.tiny_clip_processor(32))

    def save_text(folder: Path) -> None:
        tokenizer = fixtures.t5_style_tokenizer(folder)
        UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
                                    relative_attention_num_buckets=8)).save_pretrained(folder)

    text = fixtures.saved(tmp_path_factory.mktemp("umt5"), "umt5-encoder", "umt5-encoder-32", save_text)
    return vision, text


def count_forwards(module) -> list:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.slow
def test_instance_b_serves_a_s_image_features_and_negative_embedding_without_running_an_encoder(folders, tmp_path):
    vision_folder, text_folder = folders
    images = []
    for seed in (1, 2):
        (path := tmp_path / f"{seed}.png").write_bytes(png_bytes(seed))
        images.append(str(path))
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    with MooncakeMaster() as master:
        a = subprocess.Popen([sys.executable, str(root / "tests" / "encoder_instance.py"), str(vision_folder),
                              str(text_folder), master.rpc_address, master.metadata_url, str(tmp_path / "a.pt")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=env)
        client = store_tier = None
        try:
            a.stdin.write(json.dumps({"images": images, "negative": NEGATIVE, "max_length": L}) + "\n")
            a.stdin.flush()
            tower = CLIPVisionModel.from_pretrained(vision_folder).eval()  # while A starts
            processor = AutoImageProcessor.from_pretrained(vision_folder)
            umt5 = UMT5EncoderModel.from_pretrained(text_folder).eval()
            tokenizer = AutoTokenizer.from_pretrained(text_folder)
            told = json.loads(a.stdout.readline())
            assert told == {"sources": ["computed"] * 3, "published": 3}
            want = torch.load(tmp_path / "a.pt")

            client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 64 << 20, 32 << 20)
            store_tier = StoreTier(client)
            store = EncoderStore(1 << 20, 4096, tiers=EncoderTiers(store=store_tier))
            vision = CachedVisionEncoder(tower, processor, store)
            text = CachedPromptEncoder(tokenizer, umt5, store, max_sequence_length=L)
            tower_calls, text_calls = count_forwards(tower), count_forwards(umt5)
            got = [vision.lookup(p) for p in images] + [text.lookup(NEGATIVE)]
            assert [g.source for g in got] == ["shared"] * 3
            assert (tower_calls[0], text_calls[0]) == (0, 0), "instance B ran an encoder"
            for g, w in zip(got, want["images"] + [want["negative"]]):
                assert torch.equal(g.value, w) and g.value.dtype == w.dtype
            assert [g.source for g in [vision.lookup(p) for p in images]] == ["store"] * 2  # now on B's device
            t = store.stats()
            assert (t.by_modality["image"].store_hits, t.by_modality["text"].store_hits) == (2, 1)
            assert t.totals.time_saved_s > 0  # A's measured encoder time, carried in the entry

            uncached = ([CachedVisionEncoder(tower, processor, None)(p) for p in images]
                        + [CachedPromptEncoder(tokenizer, umt5, None, max_sequence_length=L)(NEGATIVE)])
            assert all(torch.equal(u, g.value) for u, g in zip(uncached, got))  # what B computes itself, bit for bit
        finally:
            a.stdin.close()
            a.wait(30)
            if store_tier is not None:
                store_tier.close()
            if client is not None:
                client.close()
