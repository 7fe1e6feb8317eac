"""``weights_fingerprint``: weights loaded from a checkpoint folder are named by the folder's files, not their bytes.

The same checkpoint gives the same fingerprint in a fresh process (the root of every page name and encoder key
survives a restart), a weight changed and saved again or another config gives another, weights not loaded from the
folder (random init from its config, another checkpoint's state dict) are never named by it, and a hub cache
snapshot is named by its blobs wherever the cache lies. Both file identities are covered: a tiny model's files are
named by their content, and with ``SMALL = 0`` by their stat, as a real model's are. Timing is the benchmark's
(``benchmarks/bench_fingerprint.py``), not a test's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

import mmcache.weights_fingerprint as wf
from mmcache import checkpoint_files
from mmcache.errors import InvalidRequest
from mmcache.module_fingerprint import module_fingerprint
from mmcache.weights_fingerprint import weights_fingerprint

ROOT = Path(__file__).resolve().parents[2]


def tiny_bert(seed: int = 0, **config) -> BertModel:
    torch.manual_seed(seed)
    return BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                                vocab_size=64, max_position_embeddings=32, **config))


@pytest.fixture(params=["content", "stat"])
def identity(request, monkeypatch) -> str:
    """How the files are named: by content (a tiny model's files), or by stat as files over ``SMALL`` are."""
    if request.param == "stat":
        monkeypatch.setattr(checkpoint_files, "SMALL", 0)
    return request.param


@pytest.fixture
def bytes_hashed(monkeypatch) -> list[str]:
    """The state-dict names ``weights_fingerprint`` hashes by their bytes (the rest it names by file)."""
    seen, hash_bytes = [], wf.update_with_tensor
    monkeypatch.setattr(wf, "update_with_tensor", lambda h, name, t, m: (seen.append(name), hash_bytes(h, name, t, m)))
    return seen


def in_a_fresh_process(folder: Path, identity: str) -> str:
    """The fingerprint a new Python process takes of the model loaded from ``folder`` (a restart)."""
    script = ("import sys; from transformers import AutoModel; from mmcache import checkpoint_files; "
              "from mmcache.weights_fingerprint import weights_fingerprint\n"
              "if sys.argv[2] == 'stat': checkpoint_files.SMALL = 0\n"
              "print(weights_fingerprint(AutoModel.from_pretrained(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", script, str(folder), identity], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "random"})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_same_checkpoint_has_the_same_fingerprint_after_a_restart(tmp_path, identity, bytes_hashed):
    tiny_bert().save_pretrained(tmp_path)
    loaded = BertModel.from_pretrained(tmp_path)
    fingerprint = weights_fingerprint(loaded)
    assert bytes_hashed == []  # every tensor named by the file, none read
    assert fingerprint != module_fingerprint(loaded)
    assert weights_fingerprint(BertModel.from_pretrained(tmp_path)) == fingerprint
    assert in_a_fresh_process(tmp_path, identity) == fingerprint


def test_one_weight_changed_and_saved_again_changes_it(tmp_path, identity):
    tiny_bert().save_pretrained(tmp_path)
    model = BertModel.from_pretrained(tmp_path)
    before = weights_fingerprint(model)
    with torch.no_grad():
        model.encoder.layer[1].output.dense.weight[3, 5] += 1e-3  # one weight, inside the file
    model.save_pretrained(tmp_path)
    assert weights_fingerprint(BertModel.from_pretrained(tmp_path)) != before


def test_another_config_changes_it(tmp_path, identity):
    tiny_bert().save_pretrained(tmp_path)
    fingerprint = weights_fingerprint(BertModel.from_pretrained(tmp_path))
    assert weights_fingerprint(BertModel.from_pretrained(tmp_path, attn_implementation="eager")) != fingerprint
    saved = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(json.dumps({**json.loads(saved), "layer_norm_eps": 1e-5}))
    assert weights_fingerprint(BertModel.from_pretrained(tmp_path)) != fingerprint
    (tmp_path / "config.json").write_text(saved)
    if identity == "content":  # the same bytes again; by stat, a rewritten file is another one (a needless miss)
        assert weights_fingerprint(BertModel.from_pretrained(tmp_path)) == fingerprint
    (tmp_path / "preprocessor_config.json").write_text('{"do_normalize": true}')  # a preprocessing file is named
    assert weights_fingerprint(BertModel.from_pretrained(tmp_path)) != fingerprint


def test_weights_not_loaded_from_the_folder_are_not_named_by_it(tmp_path, identity):
    tiny_bert(seed=0).save_pretrained(tmp_path)
    loaded = BertModel.from_pretrained(tmp_path)
    fingerprint = weights_fingerprint(loaded)
    torch.manual_seed(1)
    initialised = BertModel(AutoConfig.from_pretrained(tmp_path))  # the folder's config, its own weights
    assert initialised.config.name_or_path == str(tmp_path)
    assert weights_fingerprint(initialised) != fingerprint
    loaded.load_state_dict(tiny_bert(seed=2).state_dict())  # another checkpoint into the loaded model
    assert weights_fingerprint(loaded) not in (fingerprint, weights_fingerprint(initialised))


def test_a_model_loaded_in_another_dtype_is_named_by_file_and_apart(tmp_path, bytes_hashed):
    tiny_bert().save_pretrained(tmp_path)
    fp32 = weights_fingerprint(BertModel.from_pretrained(tmp_path))
    bf16 = BertModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert weights_fingerprint(bf16) not in (fp32, module_fingerprint(bf16)) and bytes_hashed == []
    assert weights_fingerprint(BertModel.from_pretrained(tmp_path, dtype=torch.bfloat16)) == weights_fingerprint(bf16)


def test_tied_weights_are_named_once(tmp_path, bytes_hashed):
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(tmp_path)
    model = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert weights_fingerprint(model) != module_fingerprint(model) and bytes_hashed == []


def hub_cache(cache: Path, repo: str, folder: Path) -> Path:
    """``folder`` laid out as the hub cache lays out a snapshot: files as symlinks into content-named blobs."""
    base = cache / ("models--" + repo.replace("/", "--"))
    snapshot = base / "snapshots" / ("0" * 40)
    (base / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        blob = base / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_hub_snapshot_is_named_by_its_blobs_wherever_the_cache_lies(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_files, "SMALL", 0)  # even files a stat would name are named by their blob
    tiny_bert().save_pretrained(tmp_path / "saved")
    snapshot = hub_cache(tmp_path / "cache", "org/tiny", tmp_path / "saved")
    fingerprint = weights_fingerprint(BertModel.from_pretrained(snapshot))
    shutil.copytree(tmp_path / "cache", tmp_path / "elsewhere", symlinks=True)  # another machine's cache
    moved = tmp_path / "elsewhere" / snapshot.relative_to(tmp_path / "cache")
    assert weights_fingerprint(BertModel.from_pretrained(moved)) == fingerprint
    assert checkpoint_files.resolve_folder("org/tiny", tmp_path / "cache") == snapshot
    assert checkpoint_files.resolve_folder("org/other", tmp_path / "cache") is None
    model = BertModel(BertModel.from_pretrained(snapshot).config)
    model.load_state_dict(BertModel.from_pretrained(snapshot).state_dict())
    model.config.name_or_path = "org/tiny"  # loaded by repo id: the cache's one snapshot names it
    assert weights_fingerprint(model, cache_dir=tmp_path / "cache") == fingerprint
    shutil.copytree(snapshot, snapshot.parent / ("1" * 40), symlinks=True)  # two revisions: which one is unknown
    assert weights_fingerprint(model, cache_dir=tmp_path / "cache") == module_fingerprint(model)


def test_a_subfolder_named_twice_is_one_checkpoint(tmp_path, bytes_hashed):
    """A pipeline folder given by the caller and its ``vae/`` named by the module's config (M*'s Cosmos3 loads its VAE
    from ``<repo>/vae``): the same files, not two candidates that tie."""
    tiny_bert().save_pretrained(tmp_path / "encoder")
    model = BertModel.from_pretrained(tmp_path / "encoder")
    fingerprint = weights_fingerprint(model, folders=[tmp_path])
    assert fingerprint != module_fingerprint(model) and bytes_hashed == []
    assert weights_fingerprint(BertModel.from_pretrained(tmp_path / "encoder"), folders=[tmp_path]) == fingerprint


def test_no_checkpoint_folder_falls_back_to_every_byte():
    model = tiny_bert()
    assert weights_fingerprint(model) == module_fingerprint(model)


# -- M*: the one call names its encoder nodes from the model's checkpoint folder, or takes the caller's ----------------


def whisper_model(folder: Path):
    from mstar.model.whisper.config import WhisperModelConfig
    from mstar.model.whisper.whisper_model import WhisperModel
    model = object.__new__(WhisperModel)  # its constructor resolves a hub snapshot; the rest is M*'s own
    model.local_dir, model.config, model._submodule_cache = str(folder), WhisperModelConfig.from_pretrained(
        str(folder)), {}
    return model


@pytest.fixture
def whisper_folder(tmp_path) -> Path:
    pytest.importorskip("mstar")
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(0)
    WhisperForConditionalGeneration(WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=30, vocab_size=128,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )).save_pretrained(tmp_path / "whisper")
    return tmp_path / "whisper"


def test_enable_encoder_reuse_names_m_star_nodes_by_the_model_s_checkpoint(whisper_folder, bytes_hashed):
    from mmcache.mstar import enable_encoder_reuse
    fingerprints = []
    for _ in range(2):
        model = whisper_model(whisper_folder)
        enable_encoder_reuse(model)
        node = model.get_submodule("audio_encoder", "cpu")
        fingerprints.append(node.fingerprint)
    assert fingerprints[0] == fingerprints[1] and bytes_hashed == []  # audio_encoder.* named by model.encoder.*
    assert fingerprints[0][0] != module_fingerprint(node.node)


def test_enable_encoder_reuse_takes_the_caller_s_fingerprint(whisper_folder):
    from mmcache.mstar import enable_encoder_reuse
    whole, per_node = whisper_model(whisper_folder), whisper_model(whisper_folder)
    enable_encoder_reuse(whole, fingerprint="whisper-tiny@rev1")
    enable_encoder_reuse(per_node, fingerprint={"audio_encoder": "enc@rev1"})
    assert whole.get_submodule("audio_encoder", "cpu").fingerprint[0] == "whisper-tiny@rev1/audio_encoder"
    assert per_node.get_submodule("audio_encoder", "cpu").fingerprint[0] == "enc@rev1"
    for bad in (b"bytes", {"audio_encoder": 1}, 7):
        untouched = whisper_model(whisper_folder)
        with pytest.raises(InvalidRequest, match="fingerprint"):
            enable_encoder_reuse(untouched, fingerprint=bad)
        assert not getattr(untouched, "_mmcache_encoder_reuse", False)
