"""PagedKVCache on a tiny random Llama saved and loaded back: the pages hold exactly the K/V transformers computes,
admission makes the model skip the matched tokens (model(...) and generate()), and errors and pool pressure leave the
cache and the pool consistent."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig

from conftest import save_tiny
from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.errors import InvalidRequest, OutOfPages
from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape
from mmcache.hf.runner import chunk_spans, replay, serve

P = 4  # page size
VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory, "llama", lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)))


@pytest.fixture(scope="session")
def model(llama_dir):
    return LlamaForCausalLM.from_pretrained(llama_dir, attn_implementation="sdpa").eval()


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fed(model) -> list:
    """Token counts of every forward of ``model``'s embedding (hook kept for the session: compare differences)."""
    counts = getattr(model, "_fed", None)
    if counts is None:
        counts = model._fed = []
        model.get_input_embeddings().register_forward_hook(lambda m, args, out: counts.append(args[0].shape[1]))
    return counts


def page_kv(kv: PagedKVCache, pages, n: int) -> torch.Tensor:
    """K/V of positions [0, n) read back from ``pages`` of the pool: [layers, 2, kv_heads, n, head_dim]."""
    data = kv.pool.data[torch.tensor(pages)]  # [k, layers, 2, P, heads, dim]
    return data.permute(1, 2, 4, 0, 3, 5).flatten(3, 4)[:, :, :, :n]


def dynamic_kv(cache: DynamicCache) -> torch.Tensor:
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])


def test_pages_hold_exactly_the_kv_transformers_computes(model):
    kv = PagedKVCache.for_model(model, num_pages=32, page_size=P)
    prompt = tokens(14, 1)
    kv.admit("r", prompt)
    dyn = DynamicCache(config=model.config)
    spans = chunk_spans(0, len(prompt), 2 * P)
    paged = replay(model, kv, prompt, spans, max_new_tokens=5)
    plain = replay(model, dyn, prompt, spans, max_new_tokens=5)
    assert paged.output_ids == plain.output_ids and all(map(torch.equal, paged.logits, plain.logits))
    n = len(prompt) + 4  # the last generated token is returned, never fed
    state = kv.state()
    assert kv.get_seq_length() == state.computed_tokens == n and len(state.page_indices) == -(-n // P)
    assert torch.equal(page_kv(kv, state.page_indices, n), dynamic_kv(dyn))
    # layout: page p, layer l, K/V, slot s holds [kv_heads, head_dim] of position p * P + s
    pos = 9
    assert torch.equal(kv.pool.data[state.page_indices[pos // P], 1, 0, pos % P], dyn.layers[1].keys[0, :, pos])
    assert kv.finish("r", paged.output_ids) == n // P
    assert kv.prefix.stats().pages_cached == n // P and kv.rid is None


def test_admission_makes_the_model_skip_the_matched_prefix(model):
    kv = PagedKVCache.for_model(model, num_pages=32, page_size=P)
    counts = fed(model)
    first = serve(model, kv, "a", tokens(18, 2), max_new_tokens=6)
    turn2 = tokens(18, 2) + first.output_ids + tokens(5, 3)
    before = len(counts)
    second = serve(model, kv, "b", turn2, max_new_tokens=3)
    assert second.matched_tokens == (18 + 5) // P * P  # prompt and written generated pages
    assert sum(counts[before:]) == len(turn2) - second.matched_tokens + 2
    # generate() trims the matched prefix itself, from get_seq_length()
    state = kv.admit("c", turn2)
    assert kv.get_seq_length() == state.matched_tokens > 0
    before = len(counts)
    out = model.generate(torch.tensor([turn2]), cache=kv, max_new_tokens=3, do_sample=False)  # under no_grad
    assert counts[before] == len(turn2) - state.matched_tokens
    assert out[0, len(turn2):].tolist() == second.output_ids
    kv.finish("c", out[0, len(turn2):])


def test_lifecycle_errors_leave_the_cache_usable(model):
    kv = PagedKVCache.for_model(model, num_pages=32, page_size=P)
    ids = torch.tensor([tokens(6, 4)])
    with torch.inference_mode(), pytest.raises(InvalidRequest, match="admit"):
        model(input_ids=ids, cache=kv)
    kv.admit("a", ids[0])
    with pytest.raises(InvalidRequest, match="still running"):
        kv.admit("b", ids[0])
    with pytest.raises(InvalidRequest, match="not the one running"):
        kv.finish("b")
    with torch.inference_mode(), pytest.raises(InvalidRequest, match="batch size"):
        model(input_ids=ids.repeat(2, 1), cache=kv)
    assert kv.get_seq_length() == 0
    kv.abort("a")
    assert kv.pool.num_free == kv.pool.num_pages
    assert serve(model, kv, "a", ids[0], max_new_tokens=2).output_ids


def test_pool_must_fit_the_model(model, llama_dir):
    with pytest.raises(ValueError, match="full-attention layers only"):
        kv_page_shape(MistralConfig(num_hidden_layers=2, sliding_window=64), P)
    fp = Fingerprint("tiny", kv_dtype="float32", page_size=P)
    with pytest.raises(ValueError, match="pages must be"):
        PagedKVCache(PrefixCache(PagePool(8, (2, 2, P, 4, 16)), fp), model.config)
    bf16 = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).eval()
    kv = PagedKVCache(PrefixCache(PagePool(8, kv_page_shape(model.config, P)), fp), bf16.config)
    kv.admit("a", tokens(5, 5))
    with torch.inference_mode(), pytest.raises(InvalidRequest, match="do not fit the pool"):
        bf16(input_ids=torch.tensor([tokens(5, 5)]), cache=kv)


def test_out_of_pages_raises_before_any_write(model):
    kv = PagedKVCache.for_model(model, num_pages=3, page_size=P)
    prompt = tokens(10, 6)
    with pytest.raises(OutOfPages):
        serve(model, kv, "long", prompt, max_new_tokens=4)  # 10 + 3 fed tokens need 4 pages
    # the prompt's 2 full pages were written and committed before decode ran out; nothing past them was written
    assert kv.rid is None and kv.pool.num_free == 1 and kv.prefix.stats().pages_cached == 2
    assert kv.admit("r", prompt).matched_tokens == 8
    replay(model, kv, prompt, chunk_spans(8, 10, P), max_new_tokens=3)
    state = kv.state()
    with torch.inference_mode(), pytest.raises(OutOfPages):
        model(input_ids=torch.tensor([[1]]), cache=kv)
    assert kv.get_seq_length() == kv.state().computed_tokens == 12 and kv.state().page_indices == state.page_indices
    kv.abort("r")
    assert kv.pool.num_free == 1 and kv.prefix.stats().pages_cached == 2  # the prompt's pages stay indexed


def test_cached_pages_are_evicted_for_a_live_request_and_outputs_stay_exact(model):
    kv = PagedKVCache.for_model(model, num_pages=8, page_size=P, evict_batch_pages=1)
    for seed in range(3):  # 3 x 3 written pages: the index fills the pool
        serve(model, kv, f"fill{seed}", tokens(13, 10 + seed), max_new_tokens=1)
    assert kv.prefix.stats().pages_cached >= 6
    prompt = tokens(21, 20)
    got = serve(model, kv, "new", prompt, max_new_tokens=5)
    want = replay(model, DynamicCache(config=model.config), prompt, chunk_spans(0, 21, P), max_new_tokens=5)
    assert kv.prefix.stats().evicted_pages > 0
    assert got.output_ids == want.output_ids and all(map(torch.equal, got.logits, want.logits))


def test_staging_buffer_grows_past_its_first_capacity(model):
    kv = PagedKVCache.for_model(model, num_pages=128, page_size=P)
    prompt = tokens(250, 7)  # staging starts at 256 positions; decode runs past it
    kv.admit("r", prompt)
    dyn = DynamicCache(config=model.config)
    got = replay(model, kv, prompt, chunk_spans(0, 250, 64), max_new_tokens=12)
    want = replay(model, dyn, prompt, chunk_spans(0, 250, 64), max_new_tokens=12)
    assert got.output_ids == want.output_ids and all(map(torch.equal, got.logits, want.logits))
    with torch.no_grad():  # the buffer regrown under inference_mode takes writes outside it too
        step = [model(input_ids=torch.tensor([got.output_ids[-1:]]), cache=c).logits for c in (kv, dyn)]
    assert torch.equal(*step)
    assert torch.equal(page_kv(kv, kv.state().page_indices, 262), dynamic_kv(dyn))
    kv.finish("r", got.output_ids)
