"""M*'s real Pi0.5 LLM node (``Pi05LLMSubmodule``: PaliGemma writes the prefix KV, the action expert's flow-matching
steps attend to it; a tiny random lerobot-layout checkpoint loaded by M*'s own loader) under M*'s real ``Engine`` on
CPU, reuse on (``enable_reuse`` with ``mmcache.mstar.pi05.pi05_reuse``: the prefill named as a whole by its rows'
digest) and off, on the same schedule (``workloads/peers/mstar_pi05.py``). Only flashinfer's kernels are stand-ins.

- every parameter of the node is the checkpoint's, through M*'s loader;
- the prefill attends bidirectionally: the KV of the image rows differs with the instruction after them, so no page
  of a prefix is reusable behind another instruction (why the walk is named as one item);
- bf16, a request with the same images and prompt as one before reuses every full page but the last rows' (15 of
  19 rows), and its actions after every flow step are ``torch.equal`` to reuse off, also when the two requests'
  action loops run in one batch over the shared pages;
- the same images with another instruction reuse nothing.
"""

import pytest
import torch

from mstar_helpers import all_equal, require_mstar

require_mstar()
from mmcache.mstar.pi05 import pi05_reuse, prefill_walk_media  # noqa: E402
from workloads.peers.mstar_pi05 import ACTION, CFG, LABEL, PREFILL, act, pi05_engine, prefill, save_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "sampled")  # every test runs on the stand-ins
P = 4  # page size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("pi05"))


def images(seed: int) -> torch.Tensor:
    """What the SigLIP node would hand the LLM for the cameras: 12 rows in LLM space."""
    return torch.randn(12, CFG["hidden_size"], generator=torch.Generator().manual_seed(seed))


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def serve(pe, rid: str, img, text):
    """One request: its prefill, its action loop, removed. Returns (actions after every flow step, rows the prefill
    computed)."""
    pe.engine.add_request(rid, {})
    prefill(pe, {rid: (img, text)})
    fed = pe.fed[rid]
    out = act(pe, [rid])[rid]
    pe.engine.remove_request(rid)
    return out, fed



def test_every_weight_is_loaded_from_the_checkpoint(checkpoint):
    """M*'s loader (``_lerobot_remap``, fused q/k/v and gate/up) filled every parameter of the node from the file:
    none is left as ``to_empty``'s uninitialized memory."""
    from safetensors.torch import load_file

    from workloads.peers.mstar_checkpoint import hub_parts
    from workloads.peers.mstar_pi05 import lerobot_name
    saved, sub = load_file(str(checkpoint / "model.safetensors")), pi05_engine(checkpoint).sub
    names = [n for n, _ in sub.named_parameters()]
    assert len(names) == 40  # 2 PaliGemma and 2 action-expert layers, embeddings, projections, time MLP
    for name, param in sub.named_parameters():
        want = torch.cat([saved[lerobot_name(n)] for n in hub_parts(name)])
        assert torch.equal(param.detach(), want.to(param.dtype)), name


def test_the_image_pages_kv_depends_on_the_instruction_after_them(checkpoint):
    """Bidirectional prefix attention: page 0 (image rows only) holds the same layer-0 KV (a projection of the same
    rows) but other layer-1 KV behind another instruction, so a per-row or per-page name would serve wrong KV."""
    pe, img = pi05_engine(checkpoint), images(seed=1)
    for rid, text in (("a", ids(7, seed=2)), ("b", ids(7, seed=3))):
        pe.engine.add_request(rid, {})
        prefill(pe, {rid: (img, text)})
    pages = [pe.kv._streams[rid][LABEL].page_indices[0] for rid in ("a", "b")]
    tensor = pe.kv.kv_cache.tensor
    assert torch.equal(tensor[0, pages[0]], tensor[0, pages[1]])  # [layer, page, K/V, position, head, dim]
    assert not torch.equal(tensor[1, pages[0]], tensor[1, pages[1]])


def test_the_same_observation_reuses_the_prefix_bit_exactly(checkpoint):
    on, off = pi05_engine(checkpoint, reuse=pi05_reuse("pi05-tiny@test")), pi05_engine(checkpoint)
    img, text = images(seed=4), ids(7, seed=5)
    for rid in ("a", "b"):
        got, want = serve(on, rid, img, text), serve(off, rid, img, text)
        assert all_equal(got[0], want[0]) and want[1] == 19
    assert got[1] == 19 - 4 * P  # 4 full pages reused; the page of the last rows is computed
    s = on.kv.stats(LABEL)
    assert s.hits == 1 and s.hit_tokens == 4 * P


def test_action_loops_batched_over_shared_pages_are_bit_exact(checkpoint):
    """b is prefilled while a is live (a's prefix committed), then both action loops run in one batch: b reads a's
    pages, each writes its own scratch KV after them, and neither's actions differ from reuse off."""
    on, off = pi05_engine(checkpoint, reuse=pi05_reuse("pi05-tiny@test")), pi05_engine(checkpoint)
    img, text = images(seed=6), ids(9, seed=7)
    runs = {}
    for name, pe in (("on", on), ("off", off)):
        for rid in ("a", "b"):
            pe.engine.add_request(rid, {})
            prefill(pe, {rid: (img, text)})
        fed_b = pe.fed["b"]
        if name == "on":
            held_a, held_b = (pe.kv._streams[r][LABEL].page_indices for r in ("a", "b"))
            assert held_b[:4] == held_a[:4] and (pe.kv.pool.counts[held_a[:4]] >= 2).all()
        runs[name] = act(pe, ["a", "b"]), fed_b
        for rid in ("a", "b"):
            pe.engine.remove_request(rid)
    (got, fed_on), (want, fed_off) = runs["on"], runs["off"]
    assert fed_off == 21 and fed_on == 21 - 4 * P
    assert all(all_equal(got[rid], want[rid]) for rid in ("a", "b"))


def test_the_same_images_with_another_instruction_reuse_nothing(checkpoint):
    on, off = pi05_engine(checkpoint, reuse=pi05_reuse("pi05-tiny@test")), pi05_engine(checkpoint)
    img = images(seed=8)
    serve(on, "a", img, ids(7, seed=9))
    got, want = serve(on, "b", img, ids(7, seed=10)), serve(off, "b", img, ids(7, seed=10))
    assert all_equal(got[0], want[0]) and got[1] == 19
    assert on.kv.stats(LABEL).hits == 0


def test_the_prefill_is_one_item_and_action_gen_names_nothing():
    from mstar.model.submodule_base import ARNodeInputs

    from mmcache.mstar.encoder_items import rows_digest
    rows = images(seed=11)
    assert prefill_walk_media(PREFILL, None, {}, ARNodeInputs(input_seq_len=12, input_embeds=rows)) == [
        (0, rows_digest(rows.clone()))]
    assert prefill_walk_media(ACTION, None, {}, ARNodeInputs(input_seq_len=4)) is None


def test_a_carried_image_digest_names_the_prefill_with_its_text():
    """When the data worker's ``image_digest`` reaches the LLM node, it and the text ids name the walk (not the rows):
    other text or other images give another name, equal ones the same."""
    from mstar.model.submodule_base import ARNodeInputs
    fed = ARNodeInputs(input_seq_len=19, input_embeds=torch.zeros(19, CFG["hidden_size"]))

    def name(image: int, text):
        inputs = {"image_digest": [torch.full((16,), image, dtype=torch.uint8)], "text_inputs": [text]}
        [(offset, digest)] = prefill_walk_media(PREFILL, None, inputs, fed)
        assert offset == 0 and len(digest) == 16
        return digest

    text = ids(7, seed=12)
    assert name(1, text) == name(1, text.clone())
    assert len({name(1, text), name(2, text), name(1, ids(7, seed=13))}) == 3
