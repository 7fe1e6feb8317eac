"""The bit-exact gate: the same requests with KV reuse on (PagedKVCache over a PrefixCache, EncoderStore for images)
and off (transformers' DynamicCache, the vision tower on every image), with the same schedule, compared with
``torch.equal`` on every forward's logits and on the generated tokens; float32 and bfloat16, eager and sdpa, text and
images, single requests sharing a prefix and multi-turn chats, ``model(...)`` and ``generate()``.

Same schedule: the uncached run computes every position in a forward of the same span as the cached run's K/V came
from. The cached run prefills from the matched length in page-aligned chunks of one page (so every page boundary of
a prompt is a chunk boundary) and decodes one token per forward; the uncached run replays the chunks and decode
steps that computed the matched prefix in earlier turns, then the cached run's own chunks. Every reuse test asserts
that tokens were matched and that the model was fed only the rest, so the gate cannot pass with reuse switched off.
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from conftest import save_tiny
from encoders.llava import LlavaPrefill
from mmcache.encoder_store import EncoderStore
from mmcache.hf.paged_kv import PagedKVCache
from mmcache.hf.runner import chunk_spans, generate, replay, serve

P = 4  # page size; also the prefill chunk
NEW = 5  # tokens generated per turn
VOCAB, IMAGE_TOKEN, PX = 512, 500, 32  # 4 x 4 patches of 8 px: 16 placeholders per image
MODES = [(dtype, attn) for dtype in (torch.float32, torch.bfloat16) for attn in ("eager", "sdpa")]
IDS = [f"{str(d).removeprefix('torch.')}-{a}" for d, a in MODES]


pytestmark = pytest.mark.usefixtures("one_thread")


def text_config():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    llava = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, patch_size=8, image_size=PX),
                        text_config=text_config(), image_token_id=IMAGE_TOKEN)
    return {"llama": save_tiny(tmp_path_factory, "llama", lambda: LlamaForCausalLM(text_config())),
            "llava": save_tiny(tmp_path_factory, "llava", lambda: LlavaForConditionalGeneration(llava))}


_loaded = {}


def load(folders, kind, dtype, attn):
    """The model saved in ``folders[kind]``, loaded once per (dtype, attention), with a counter of embedded tokens
    (``model._fed``) and of vision tower forwards (``model._tower``)."""
    key = kind, dtype, attn
    if key not in _loaded:
        cls = LlamaForCausalLM if kind == "llama" else LlavaForConditionalGeneration
        model = cls.from_pretrained(folders[kind], attn_implementation=attn, dtype=dtype).eval()
        model._fed, model._tower = [], [0]
        model.get_input_embeddings().register_forward_hook(lambda m, a, o: model._fed.append(a[0].shape[1]))
        if kind == "llava":
            model.model.vision_tower.register_forward_hook(lambda *_: model._tower.__setitem__(0, model._tower[0] + 1))
        _loaded[key] = model
    return _loaded[key]


def tokens(n, seed):
    return torch.randint(0, IMAGE_TOKEN, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def png(seed) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def processor():
    return CLIPImageProcessorPil(size={"shortest_edge": PX}, crop_size={"height": PX, "width": PX})


class Conversation:
    """One chat's turns, each served cached and replayed uncached with the schedule that computed its prefix."""

    def __init__(self, model, reference=None):
        self.model, self.reference = model, reference  # VLM: the uncached pipeline's embedder (prompt -> embed)
        self.schedule = None  # every forward span that computed the last turn's K/V
        self.towers = 0  # vision tower forwards of the last cached turn

    def turn(self, rid, prompt, serve_fn, expect_hit=True, **kwargs):
        """Serve ``prompt`` cached, check that only the unmatched rest was fed, replay it uncached, compare."""
        model = self.model
        ids = getattr(prompt, "token_ids", prompt)
        n, fed, towers = len(ids), len(model._fed), model._tower[0]
        got = serve_fn(rid, prompt, max_new_tokens=NEW, chunk_tokens=P, **kwargs)
        self.towers = model._tower[0] - towers
        m = got.matched_tokens
        assert (m > 0) == expect_hit
        assert sum(model._fed[fed:]) == n - m + NEW - 1
        prefix = [s for s in self.schedule or chunk_spans(0, m, P) if s[1] <= m]
        assert (prefix[-1][1] if prefix else 0) == m
        want = replay(model, DynamicCache(config=model.config), ids, prefix + [s for s in got.spans if s[1] <= n],
                      max_new_tokens=NEW, embed=self.reference(prompt) if self.reference else None)
        assert want.output_ids == got.output_ids and want.spans[len(prefix):] == got.spans
        assert len(want.logits) == len(prefix) + len(got.logits)
        assert all(torch.equal(a, b) for a, b in zip(want.logits[len(prefix):], got.logits))
        self.schedule = want.spans
        return got


@pytest.mark.parametrize("dtype,attn", MODES, ids=IDS)
def test_text_chats_sharing_a_system_prompt(folders, dtype, attn):
    model = load(folders, "llama", dtype, attn)
    kv = PagedKVCache.for_model(model, num_pages=96, page_size=P)
    system = tokens(10, 1)

    def text_serve(rid, prompt, **kw):
        return serve(model, kv, rid, prompt, **kw)

    for c in range(2):  # the second chat's first turn hits the first chat's system prompt pages
        chat, prompt, written = Conversation(model), system, c and len(system) // P * P
        for t in range(3):
            prompt = prompt + tokens(7, 100 + 10 * c + t)
            got = chat.turn(f"chat{c}.{t}", prompt, text_serve, expect_hit=(c, t) != (0, 0))
            assert got.matched_tokens == written
            written = (len(prompt) + NEW - 1) // P * P  # every full page of prompt and fed generated tokens
            prompt = prompt + got.output_ids
    assert kv.prefix.stats().hits == 5


@pytest.mark.parametrize("dtype,attn", MODES, ids=IDS)
def test_vlm_chats_with_images_in_the_chain(folders, dtype, attn):
    model = load(folders, "llava", dtype, attn)
    kv = PagedKVCache.for_model(model, num_pages=160, page_size=P)
    store = EncoderStore(1 << 20, 4096)
    chat, plain = LlavaPrefill(model, processor(), kv, store), LlavaPrefill(model, processor())
    cat, dog, system = png(1), png(2), tokens(6, 1)  # the image's first placeholder lies mid-page

    def vlm_serve(rid, prompt, **kw):
        return chat.serve(rid, prompt, **kw)

    # multi-turn: each turn re-sends the image and the history; only the first runs the tower
    conv, written = Conversation(model, plain.embedder), 0
    prompt = chat.prompt(system, cat, tokens(5, 2))
    for t in range(3):
        got = conv.turn(f"cat.{t}", prompt, vlm_serve, expect_hit=t > 0)
        assert got.matched_tokens == written and conv.towers == (t == 0)
        written = (len(prompt.token_ids) + NEW - 1) // P * P
        prompt = chat.prompt(prompt, got.output_ids, tokens(5, 3 + t))
    # the same image behind the same text hits through the image; its last rows come from the encoder store
    hits = store.stats().totals.hits
    same = Conversation(model, plain.embedder)
    got = same.turn("cat.again", chat.prompt(system, cat, tokens(9, 9)), vlm_serve)
    assert got.matched_tokens == (6 + 16) // P * P and same.towers == 0 and store.stats().totals.hits == hits + 1
    # the same tokens with a different image miss from the page of its first placeholder on
    other = Conversation(model, plain.embedder)
    got = other.turn("dog", chat.prompt(system, dog, tokens(9, 9)), vlm_serve)
    assert got.matched_tokens == 6 // P * P and other.towers == 1


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "llava"])
def test_generate_with_a_paged_cache_equals_dynamic_cache(folders, kind, attn):
    model = load(folders, kind, torch.float32, attn)
    kv = PagedKVCache.for_model(model, num_pages=96, page_size=P)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
    if kind == "llama":  # transformers chunks the prefill from the matched length, a page boundary
        kwargs["prefill_chunk_size"] = P
        first, second = tokens(13, 1) + tokens(6, 2), tokens(13, 1) + tokens(9, 3)
        generate(model, kv, "first", first, **kwargs)
        fed = len(model._fed)
        got = generate(model, kv, "second", second, **kwargs)
        ids, embed = torch.tensor([second]), None
    else:  # transformers cannot chunk an inputs_embeds prefill: the shared prefix is computed page by page
        chat = LlavaPrefill(model, processor(), kv, EncoderStore(1 << 20, 4096))
        first, second = (chat.prompt(tokens(5, 1), png(3), ids) for ids in (tokens(6, 2), tokens(9, 3)))
        chat.serve("first", first, max_new_tokens=NEW, chunk_tokens=P)
        fed = len(model._fed)
        got = chat.generate("second", second, **kwargs)
        ids, embed = torch.tensor([second.token_ids]), LlavaPrefill(model, processor()).embedder(second)
    m = kv.prefix.stats().hit_tokens
    assert m >= 12 and sum(model._fed[fed:]) == ids.shape[1] - m + NEW - 1
    dyn = DynamicCache(config=model.config)
    replay(model, dyn, ids[0], chunk_spans(0, m, P), embed=embed)
    with torch.inference_mode():
        inputs = {"input_ids": ids}
        if embed is not None:
            rest = embed(m, ids.shape[1])
            inputs["inputs_embeds"] = torch.cat((rest.new_zeros(1, m, rest.shape[-1]), rest), 1)
        want = model.generate(**inputs, cache=dyn, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_forced_name_collisions_cost_a_miss_never_a_wrong_answer(folders, attn):
    model = load(folders, "llama", torch.float32, attn)
    kv = PagedKVCache.for_model(model, num_pages=96, page_size=P)
    c = 0x5EED
    shared = tokens(P, 1)
    first, sibling, stranger = shared + tokens(11, 2), shared + tokens(11, 3), tokens(15, 4)

    def forced(rid, prompt, **kw):  # every page of every prompt gets the same name
        return serve(model, kv, rid, prompt, names=[c] * (len(prompt) // P), **kw)

    Conversation(model).turn("first", first, forced, expect_hit=False)
    got = Conversation(model).turn("sibling", sibling, forced)
    assert got.matched_tokens == P  # page 0 verifies; page 1 is nominated by name but is not its own parent
    Conversation(model).turn("stranger", stranger, forced, expect_hit=False)
    assert kv.prefix.stats().collisions >= 2
