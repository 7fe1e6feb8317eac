"""Helpers for the tests that run M*'s own encoder submodules under its real ``Engine`` (mstar-ai 0.2.1) on the CPU:
the engine as M*'s worker builds it over a model (``worker_engine``, ``served_node``: the one call first) or over
given submodules (``engine``), batches as M*'s worker builds them (``Worker._make_executing_batch``), driven through
the engine's own ``prepare_inputs`` -> ``exec_and_postprocess`` -> ``finalize_batch``, forward counters (hooks on
the encoder inside the node, so the node runs unchanged), and Qwen3-Omni's data worker over its own
``process_prompt``. The tiny checkpoints are ``mstar_encoder_checkpoints``."""

import sys

import torch

from mstar_helpers import require_mstar  # noqa: F401  (the encoder tests' modules skip through it)


def install_flashinfer_standin(monkeypatch):
    """Qwen3-Omni's talker.py imports flashinfer at module level; flashinfer has no CPU build."""
    from workloads.peers.mstar_cpu_kernels import flashinfer_module
    if "flashinfer" not in sys.modules:
        monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_module())


def saved_model(folder_root, kind: str, config, cls):
    """``cls.from_pretrained`` of a ``cls(config)`` with random weights saved once under ``folder_root``."""
    from workloads import fixtures
    folder = fixtures.saved(folder_root, kind, config.to_json_string(), lambda f: cls(config).save_pretrained(f))
    return cls.from_pretrained(folder).eval()


class CpuEngine:
    """M*'s ``Engine`` on the CPU, one worker of one rank; ``run`` drives one batch the way M*'s worker does and
    returns rid -> outputs."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, node: str, walk: str, requests: dict, step_metadata: dict | None = None) -> dict:
        """``requests`` (rid -> {input name: [tensors]}) as one batch of ``node`` on ``walk``: rid -> outputs."""
        for rid in requests:
            self.engine.add_request(rid)
        b = batch(node, walk, requests, step_metadata)
        self.engine.prepare_inputs(b)
        assert not b.failed_requests, b.failed_requests
        out = self.engine.exec_and_postprocess(b)
        self.engine.finalize_batch(b)
        return out

    def remove_request(self, rid: str):
        self.engine.remove_request(rid)


def _one_rank():
    from mstar.communication.tensors import LocalTransferEngine
    from mstar.distributed.communication import WorkerParallelGroups
    from mstar.engine.resources.kv.transfer import TransferEngineInfo
    return (WorkerParallelGroups(num_workers=1, global_rank=0),
            TransferEngineInfo("e", "s", LocalTransferEngine("h")))


def engine(submodules: dict, autocast=None) -> CpuEngine:
    """An ``Engine`` with ``submodules`` loaded as given (no resource specs: encoder nodes own none)."""
    from mstar.engine.engine import Engine
    groups, transfer = _one_rank()
    eng = Engine(autocast_dtype=autocast)
    eng.load_model(submodules, specs=[], parallel_groups=groups, device=torch.device("cpu"),
                   transfer_engine_info=transfer)
    eng.warmup()
    return CpuEngine(eng)


def worker_engine(model, node_names) -> CpuEngine:
    """The engine M*'s worker builds for ``node_names`` of ``model``: ``EngineManager.build`` (the model's resource
    specs; ``model.get_submodule`` per node, then its ``to(device, dtype)`` in the model's autocast dtype or the
    node's own; ``Engine.load_model``) and ``warmup_all``. Each node is loaded first with the device as the string
    ``"cpu"`` (M*'s safetensors loaders hand ``safe_open`` "cuda" for ``torch.device("cuda")`` but the
    ``torch.device("cpu")`` itself, which it refuses); the build's own ``get_submodule`` gets it from the model's
    submodule cache."""
    from mstar.worker.engine_manager import EngineManager
    for name in node_names:
        model.get_submodule(name, "cpu")
    groups, transfer = _one_rank()
    manager = EngineManager.build(set(node_names), torch.device("cpu"), {}, groups, transfer, model)
    manager.warmup_all()
    return CpuEngine(manager.engine)


def batch(node: str, walk: str, requests: dict, step_metadata: dict | None = None):
    """An ``ExecutingBatch`` of ``requests`` (rid -> {input name: [tensors]}) as M*'s worker builds it."""
    from mstar.conductor.request_info import CurrentForwardPassInfo
    from mstar.engine.engine import ExecutingBatch
    from mstar.engine.resources import StepContext
    infos = {rid: CurrentForwardPassInfo(request_id=rid, graph_walk=walk, fwd_index=0, random_seed=0, max_tokens=1,
                                         step_metadata=dict(step_metadata or {}))
             for rid in requests}
    return ExecutingBatch(node_name=node, per_request_info=infos, per_request_input_tensors=dict(requests),
                          step_context=StepContext(request_ids=tuple(requests), graph_walk=walk, slot=0,
                                                   capture=False))


class ForwardCount:
    """Calls of ``module.forward`` (a forward pre-hook) and the batch rows they covered."""

    def __init__(self, module):
        self.calls = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1


def assert_equal_outputs(got: dict, want: dict):
    """Per request, the same output names and bit-identical tensors."""
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid].keys() == want[rid].keys(), rid
        for name in want[rid]:
            assert len(got[rid][name]) == len(want[rid][name]), (rid, name)
            for a, b in zip(got[rid][name], want[rid][name]):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (rid, name)


def served_node(model, node: str, reuse: bool = True, capacity_bytes: int = 1 << 22) -> tuple[CpuEngine, object]:
    """``(engine, submodule)``: with ``reuse``, the one call (``enable_encoder_reuse``) on ``model`` first; then the
    worker's engine over ``model``'s ``node`` (``worker_engine``) and the submodule it holds (a ``CachedEncoderNode``
    with reuse on)."""
    from mmcache.mstar import enable_encoder_reuse
    if reuse:
        enable_encoder_reuse(model, capacity_bytes=capacity_bytes, page_bytes=4096)
    eng = worker_engine(model, [node])
    return eng, eng.engine._submodules[node].submodule


# -- Qwen3-Omni: the model's own process_prompt, M*'s data worker --------------------------------------------------
def qwen3_omni_processors():
    """The HF image processor and feature extractor Qwen3-Omni uses (the image one the tiny thinker's,
    ``image_processor``: capped at 128x128 pixels so the tiny tower stays fast)."""
    from transformers import WhisperFeatureExtractor

    from workloads.peers.mstar_qwen3_omni import image_processor
    return image_processor(), WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)


class _Tokenizer:
    """Bytes as ids, Qwen3-Omni's placeholder sentinels as ids 256 and up (what ``process_prompt`` scans for)."""

    SPECIALS = ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>", "<|vision_start|>", "<|image_pad|>",
                "<|video_pad|>", "<|vision_end|>")
    unk_token_id = -1

    def convert_tokens_to_ids(self, token):
        return 256 + self.SPECIALS.index(token) if token in self.SPECIALS else self.unk_token_id

    def __call__(self, text, return_tensors=None):
        import re
        ids = []
        for piece in re.split(r"(<\|[a-z_]+\|>)", text):
            ids += [self.convert_tokens_to_ids(piece)] if piece in self.SPECIALS else list(piece.encode())
        return {"input_ids": torch.tensor([ids])}


_PARTS = {"audio": "<|audio_start|><|audio_pad|><|audio_end|>", "image": "<|vision_start|><|image_pad|><|vision_end|>",
          "video": "<|vision_start|><|video_pad|><|vision_end|>"}


def _chat_template(messages, **_):
    """A one-line chat template: the text parts, each media part as its sentinels (0.2.1 passes content as a string
    or a list of typed parts)."""
    def render(content):
        if isinstance(content, str):
            return content
        return "".join(p.get("text", "") if p["type"] == "text" else _PARTS[p["type"]] for p in content)
    return "".join(render(m["content"]) for m in messages) + "<assistant>"


def qwen3_omni_on_cpu(monkeypatch, root):
    """The tiny Qwen3-Omni encoders' checkpoint written under ``root`` and Qwen3-Omni's processors, with what its
    encoder nodes need on the CPU put in through ``monkeypatch`` (the flashinfer stand-in, sdpa towers): ``(weights
    folder, the towers it was written from, image processor, feature extractor)``."""
    from mstar_encoder_checkpoints import qwen3_omni_encoders, sdpa_encoder_towers

    install_flashinfer_standin(monkeypatch)
    sdpa_encoder_towers(monkeypatch)
    weights, towers = qwen3_omni_encoders(root)
    return (weights, towers, *qwen3_omni_processors())


def qwen3_omni_model(image_processor, feature_extractor, weights=None):
    """M*'s ``Qwen3OmniModel`` with its checkpoint-loading constructor skipped: its own ``process_prompt`` and
    schedule run over the given processors, a byte tokenizer and a one-line chat template. With ``weights`` (a
    folder from ``mstar_encoder_checkpoints.qwen3_omni_encoders``), its own ``get_submodule`` loads the encoder nodes
    from there (the towers need ``sdpa_encoder_towers`` on the CPU) and its config is the tiny thinker's."""
    import types

    from mstar.model.qwen3_omni import qwen3_omni_model as q
    model = object.__new__(q.Qwen3OmniModel)
    model._processor = types.SimpleNamespace(image_processor=image_processor, feature_extractor=feature_extractor,
                                             apply_chat_template=_chat_template)
    model.tokenizer = _Tokenizer()
    if weights is not None:
        from workloads.peers.mstar_qwen3_omni import model_config
        model.config, model.local_dir, model.model_path_hf = model_config(), str(weights), str(weights)
        model.cache_dir, model._submodule_cache = None, {}
    return model


class RecordingTensorManager:
    """What M*'s data worker hands its tensor manager, kept in memory (the transport is not under test)."""

    def __init__(self):
        self.stored, self.infos = {}, {}

    def store_and_return_tensor_info(self, request_id, tensors, **_):
        import types
        import uuid
        self.stored[request_id] = tensors
        self.infos[request_id] = {name: [types.SimpleNamespace(uuid=uuid.uuid4().hex, tensor=t) for t in ts]
                                  for name, ts in tensors.items()}
        return self.infos[request_id]

    def register_for_send(self, *args, **kwargs):
        pass

    def set_persist(self, *args, **kwargs):
        pass


class RecordingCommunicator:
    def __init__(self):
        self.sent = []

    def send(self, dest, msg):
        self.sent.append((dest, msg))


def data_worker(model):
    """M*'s ``PreprocessWorkerThread`` (the data worker) over ``model``, with in-memory transport."""
    import queue
    import threading

    from mstar.api_server.data_worker import PreprocessWorkerThread
    q = queue.Queue
    return PreprocessWorkerThread(in_queue=q(), result_tensor_queue=q(), out_queue=q(), profile_queue=q(),
                                  cleanup_request_queue=q(), abort_request_queue=q(), reads_done_queue=q(),
                                  discard_tensor_queue=q(),
                                  stop_event=threading.Event(), communicator=RecordingCommunicator(),
                                  tensor_manager=RecordingTensorManager(), model=model)


def preprocess(worker, rid, modality, path, text="Describe it.", model_kwargs=None):
    """The request's tensors as M*'s data worker stores them (decode, process_prompt, the digest hook)."""
    from mstar.api_server.request_types import PreprocessInput
    worker._process_input(PreprocessInput(request_id=rid, text=text, file_paths={modality: [str(path)]},
                                          input_modalities=["text", modality], output_modalities=["text"],
                                          model_kwargs=dict(model_kwargs or {})))
    return worker.tensor_manager.stored[rid]


def load_audio_16k(filepath, device):
    """M*'s ``load_audio`` contract (mono float at 16 kHz) without torchcodec (which M*'s own needs): mmcache's WAV
    reader, resampled with torchaudio."""
    import torchaudio
    from mstar.model.base import TensorAndMetadata

    from digests import load_wav
    wave, rate = load_wav(filepath)
    mono = torchaudio.functional.resample(wave.mean(0), rate, 16000)
    return TensorAndMetadata(data=mono.to(device), metadata=dict(sample_rate=16000, num_channels=1))
