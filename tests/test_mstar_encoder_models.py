"""Every other M* 0.2.1 encoder node that runs on the CPU, wrapped in ``CachedEncoderNode`` under M*'s real
``Engine``: Whisper's and Higgs Audio's audio encoders, Pi0.5's SigLIP ViT, V-JEPA 2's video encoder, Wan 2.2's and
Cosmos3's VAE encoders (the first frame / the conditioning clip), BAGEL's ViT (its SDPA fallback, flash-attn absent).
Each at a tiny random config (the HF towers saved with ``save_pretrained`` and loaded back with ``from_pretrained``;
M*'s own component classes seeded), the SAME node
instance in a plain and in a wrapped engine. A first batch misses; a second batch mixes two hits, two misses and a
repeat of a miss: every request's outputs are ``torch.equal`` to the plain engine's on the same batches, and the
hook on the tower counts exactly the misses' forwards (one sub-batch when the node batches, one per miss when not)."""

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from mstar_encoder_helpers import ForwardCount, assert_equal_outputs, engine, require_mstar, saved_model

require_mstar()

from mmcache.mstar.encoder_items import items_for  # noqa: E402
from mmcache.mstar.encoder_node import CachedEncoderNode  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Case:
    node: object
    tower: torch.nn.Module  # the module whose forward is one encoder run
    walk: str
    request: Callable[[int], dict]  # distinct request inputs per seed
    step_metadata: dict | None = None


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def whisper(root) -> Case:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from mstar.model.whisper.submodules import WhisperEncoderSubmodule
    cfg = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                        max_source_positions=30)
    tower = saved_model(root, "whisper-encoder", cfg, WhisperEncoder)
    return Case(WhisperEncoderSubmodule(tower, config=None), tower, "encode",
                lambda s: {"audio_features": [_randn(s, 16, 60)]})


def higgs_audio(root) -> Case:
    from mstar.model.higgs_audio.components.audio_tower import HiggsAudioFeatureProjector, HiggsAudioTower
    from mstar.model.higgs_audio.config import HiggsAudioModelConfig
    from mstar.model.higgs_audio.submodules import HiggsAudioEncoderSubmodule
    cfg = HiggsAudioModelConfig(hidden_size=32, audio_d_model=32, audio_encoder_layers=2,
                                audio_encoder_attention_heads=2, audio_encoder_ffn_dim=64, audio_num_mel_bins=16,
                                audio_max_source_positions=64)
    torch.manual_seed(0)
    tower, projector = HiggsAudioTower(cfg).eval(), HiggsAudioFeatureProjector(cfg).eval()
    return Case(HiggsAudioEncoderSubmodule(tower, projector, cfg), tower, "encode_audio",
                lambda s: {"audio_features": [_randn(s, 2, 16, 40)], "audio_feature_lens": [torch.tensor([40, 24])]})


def pi05(root) -> Case:
    from mstar.model.pi05.components.siglip import Pi05SiglipEncoder
    from mstar.model.pi05.config import Pi05Config
    from mstar.model.pi05.submodules import Pi05ViTEncoderSubmodule
    cfg = Pi05Config(vit_hidden_size=32, vit_intermediate_size=64, vit_num_layers=2, vit_num_heads=2,
                     vit_image_size=32, vit_patch_size=8, hidden_size=32)
    torch.manual_seed(0)
    tower = Pi05SiglipEncoder(cfg).eval()
    return Case(Pi05ViTEncoderSubmodule(tower, cfg), tower, "prefill",
                lambda s: {"image_inputs": [_randn(s, 2, 3, 32, 32).clamp(-1, 1)]})


def vjepa2(root) -> Case:
    from mstar.model.vjepa2.components.vit_encoder import VJEPA2Encoder
    from mstar.model.vjepa2.config import VJepa2Config
    from mstar.model.vjepa2.submodules import VJepa2EncoderSubmodule
    cfg = VJepa2Config(patch_size=8, crop_size=16, frames_per_clip=4, tubelet_size=2, hidden_size=32,
                       num_attention_heads=2, num_hidden_layers=2)
    torch.manual_seed(0)
    tower = VJEPA2Encoder(cfg).eval()
    return Case(VJepa2EncoderSubmodule(tower, cfg), tower, "encode",
                lambda s: {"video_frames": [_randn(s, 4, 3, 16, 16)]})


def _tiny_wan_vae(root):
    from diffusers import AutoencoderKLWan
    cfg = dict(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False],
               latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
    torch.manual_seed(0)
    folder = root / "wan-vae"
    if not folder.is_dir():
        AutoencoderKLWan(**cfg).save_pretrained(folder)
    return AutoencoderKLWan.from_pretrained(folder).eval()


def wan22_vae(root) -> Case:
    from mstar.model.wan22.config import Wan22Config
    from mstar.model.wan22.submodules import Wan22VaeEncoderSubmodule
    vae = _tiny_wan_vae(root)
    return Case(Wan22VaeEncoderSubmodule(vae, Wan22Config(vae_z_dim=4)), vae.encoder, "encode_image",
                lambda s: {"image_inputs": [_randn(s, 3, 16, 16).sigmoid()]})


def cosmos3_vae(root) -> Case:
    from mstar.model.cosmos3.config import Cosmos3Config, Cosmos3VAEConfig
    from mstar.model.cosmos3.submodules import Cosmos3VAEEncoderSubmodule
    vae = _tiny_wan_vae(root)
    config = Cosmos3Config(vae=Cosmos3VAEConfig(scale_factor_spatial=2, scale_factor_temporal=1), latent_channel=4)
    return Case(Cosmos3VAEEncoderSubmodule(vae, config), vae.encoder, "vae_encode",
                lambda s: {"image_inputs": [_randn(s, 3, 16, 16).sigmoid()]},
                {"height": 16, "width": 16, "num_frames": 1})


def bagel_vit(root) -> Case:
    from mstar.model.bagel.components.modeling_utils import BagelMLPconnector, PositionEmbedding
    from mstar.model.bagel.components.vit_encoder import BagelVisionModel
    from mstar.model.bagel.config import BagelViTConfig
    from mstar.model.bagel.submodules import ViTEncoderSubmodule
    cfg = BagelViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                         patch_size=14, image_size=980)
    torch.manual_seed(0)
    vit = BagelVisionModel(cfg).eval()
    vit.vision_model.embeddings.convert_conv2d_to_linear(cfg)  # as BagelModel loads it
    node = ViTEncoderSubmodule(vit, BagelMLPconnector(32, 32, "gelu_pytorch_tanh"), PositionEmbedding(70, 32), 14, 70)
    # the tower runs through its encode(), not forward(): count the connector, which runs once a forward
    return Case(node, node.connector, "prefill_vit", lambda s: {"image_inputs": [_randn(s, 3, 24, 32).sigmoid()]})


CASES = {"whisper": whisper, "higgs_audio": higgs_audio, "pi05": pi05, "vjepa2": vjepa2, "wan22_vae": wan22_vae,
         "cosmos3_vae": cosmos3_vae, "bagel_vit": bagel_vit}


@pytest.mark.parametrize("name", CASES)
def test_mixed_batches_bit_identical_and_only_misses_run(name, tmp_path_factory):
    case = CASES[name](tmp_path_factory.mktemp(name))
    cached = CachedEncoderNode(case.node, items_for(case.node), capacity_bytes=1 << 24, page_bytes=4096)
    plain, wrapped = engine({"enc": case.node}), engine({"enc": cached})
    count = ForwardCount(case.tower)
    x = [case.request(s) for s in range(4)]
    batches = [{"a0": x[0], "a1": x[1]}, {"b0": x[0], "b1": x[2], "b2": x[1], "b3": x[2], "b4": x[3]}]
    for n, reqs in enumerate(batches):
        before = count.calls
        got = wrapped.run("enc", case.walk, reqs, case.step_metadata)
        ran = count.calls - before
        want = plain.run("enc", case.walk, reqs, case.step_metadata)
        assert_equal_outputs(got, want)
        misses = 2  # a0/a1 in the first batch; x2 (twice) and x3 in the second
        assert ran in (1, misses), (name, n, ran)  # one sub-batch, or one forward per miss
    c = cached.counters
    assert (c.hits, c.misses, c.joins, c.forward_items) == (2, 4, 1, 4)
    for rid in (*batches[0], *batches[1]):
        wrapped.remove_request(rid)
    assert not cached._pins and set(cached.store.pool.counts[cached.store.pool.counts > 0].tolist()) == {1}


def test_the_node_and_a_direct_store_caller_share_one_flight(tmp_path_factory):
    """A miss the node is computing is joined by a concurrent ``EncoderStore.get_or_compute`` on the same key (the
    store's one in-flight table): the tower runs once and both get its output."""
    import threading

    from mstar_encoder_helpers import batch

    from conftest import wait_for
    case = whisper(tmp_path_factory.mktemp("whisper"))
    cached = CachedEncoderNode(case.node, items_for(case.node), capacity_bytes=1 << 24, page_bytes=4096)
    wrapped = engine({"enc": cached})
    count, started, go = ForwardCount(case.tower), threading.Event(), threading.Event()
    case.tower.register_forward_pre_hook(lambda *_: (started.set(), go.wait(10)) and None)
    x = case.request(7)
    b = batch("enc", case.walk, {"a": x})
    key = cached.prepare_inputs(case.walk, b.per_request_info["a"], x).kwargs["prepared"].keys[0]
    out = {}
    node_thread = threading.Thread(target=lambda: out.update(wrapped.run("enc", case.walk, {"a": x})))
    node_thread.start()
    started.wait(10)
    store_thread = threading.Thread(target=lambda: out.update(
        direct=cached.store.get_or_compute(key, lambda: pytest.fail("the node's flight must be joined"))))
    store_thread.start()
    wait_for(lambda: cached.store.stats().totals.joins == 1)
    go.set()
    node_thread.join(10)
    store_thread.join(10)
    assert count.calls == 1 and out["direct"].source == "joined"
    assert torch.equal(out["direct"].value["encoder_states"][0], out["a"]["encoder_states"][0])


def test_one_call_on_m_star_s_whisper_model_wraps_its_encoder_node(tmp_path):
    """``enable_encoder_reuse`` on M*'s own ``WhisperModel`` (over a tiny checkpoint saved with ``save_pretrained``):
    ``get_submodule`` hands M*'s engine manager the wrapped encoder (made once), the
    manager's ``to(device, dtype)`` reaches the node, and under the Engine the wrapped node equals a plain one."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from mstar.model.whisper.config import WhisperModelConfig
    from mstar.model.whisper.whisper_model import WhisperModel

    from mmcache.mstar import enable_encoder_reuse
    cfg = WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                        max_source_positions=30, vocab_size=128, max_target_positions=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    WhisperForConditionalGeneration(cfg).save_pretrained(tmp_path)

    def m_star_model():
        model = object.__new__(WhisperModel)  # its constructor resolves a hub snapshot; the rest is M*'s own
        model.local_dir, model.config, model._submodule_cache = str(tmp_path), \
            WhisperModelConfig.from_pretrained(str(tmp_path)), {}
        return model

    on, off = m_star_model(), m_star_model()
    enable_encoder_reuse(on, capacity_bytes=1 << 22, page_bytes=4096)
    enable_encoder_reuse(on)  # idempotent
    node = on.get_submodule("audio_encoder", "cpu")
    assert isinstance(node, CachedEncoderNode) and on.get_submodule("audio_encoder", "cpu") is node
    assert node.to(device="cpu", dtype=torch.float32) is node  # what M*'s engine manager does next
    plain = off.get_submodule("audio_encoder", "cpu")
    wrapped, bare = engine({"audio_encoder": node}), engine({"audio_encoder": plain})
    x = {"audio_features": [_randn(3, 16, 60)]}
    for rid in ("a", "b"):
        assert_equal_outputs(wrapped.run("audio_encoder", "encode", {rid: x}),
                             bare.run("audio_encoder", "encode", {rid: x}))
    assert (node.counters.misses, node.counters.hits) == (1, 1)


def test_bad_input_is_refused_before_any_state_changes(tmp_path_factory):
    """Nodes that own engine resources, nodes whose outputs must not be reused, and a bad salt: a clear mmcache error,
    nothing stored, the rest of the batch served."""
    from mstar.model.bagel.submodules import VAEEncoderSubmodule
    from mstar.model.whisper.submodules import WhisperDecoderSubmodule

    from mmcache.errors import InvalidRequest
    from mstar_encoder_helpers import batch
    with pytest.raises(InvalidRequest, match="declares engine steps"):
        CachedEncoderNode(object.__new__(WhisperDecoderSubmodule), None)
    with pytest.raises(InvalidRequest, match="samples its latent"):
        items_for(object.__new__(VAEEncoderSubmodule))
    with pytest.raises(InvalidRequest, match="NodeSubmodule"):
        CachedEncoderNode(torch.nn.Linear(2, 2), None)
    case = whisper(tmp_path_factory.mktemp("whisper"))
    cached = CachedEncoderNode(case.node, items_for(case.node), capacity_bytes=1 << 22, page_bytes=4096)
    eng = engine({"enc": cached}).engine
    for rid in ("good", "bad"):
        eng.add_request(rid)
    b = batch("enc", case.walk, {"good": case.request(1), "bad": case.request(2)})
    b.per_request_info["bad"].step_metadata["mmcache_salt"] = 7
    eng.prepare_inputs(b)
    assert "InvalidRequest" in b.failed_requests["bad"] and list(b.request_ids) == ["good"]
    out = eng.exec_and_postprocess(b)
    assert set(out) == {"good"} and len(cached.store) == 1 and cached.counters.misses == 1
