"""M*'s real ``Engine`` on this CPU for the model harnesses of ``workloads.peers`` (Orpheus, Higgs Audio, Qwen3-TTS,
Pi0.5, Qwen3-Omni, BAGEL): built as M*'s worker builds one (``cpu_engine``) and driven one batch at a time as M*'s
worker drives it (``run_batch``). Model-specific setup stays in each model's module; the CPU stand-ins for
flashinfer's and triton's kernels are ``workloads.peers.mstar_cpu_kernels``."""

from __future__ import annotations

import torch

from mmcache.mstar.requirement import require_mstar

require_mstar()
from mstar.communication.tensors import LocalTransferEngine  # noqa: E402
from mstar.conductor.request_info import CurrentForwardPassInfo  # noqa: E402
from mstar.distributed.communication import CommGroup, WorkerParallelGroups  # noqa: E402
from mstar.engine.engine import Engine, ExecutingBatch  # noqa: E402
from mstar.engine.resources import StepContext  # noqa: E402
from mstar.engine.resources.kv.transfer import TransferEngineInfo  # noqa: E402

from mmcache.mstar import PrefixReuse, enable_reuse  # noqa: E402


def cpu_engine(model, node_names: list[str], *, pages: int, page_size: int, dtype: torch.dtype, kv_key: str,
               rope_key: str, reuse: PrefixReuse | None = None, label: str = "main") -> tuple[Engine, dict]:
    """M*'s ``Engine`` over ``model`` on this CPU, as M*'s worker builds one (with ``reuse``, ``enable_reuse`` first,
    on the first node's ``kv_key`` resource under ``label``; encoder nodes left as they are): the model's specs with
    the KV spec sized by the deployment's overrides (``pages`` x ``page_size``) and, for an fp32 run, RoPE in fp32
    (M*'s ``RopeManager`` rotates fp32 in bf16 unless its config names ``rope_dtype``); the submodules named (the
    first, the LM, under ``dtype``'s autocast with a trivial TP group); ``load_model`` and ``warmup``. Returns the
    engine and its submodules by name."""
    if reuse is not None:
        model = enable_reuse(model, reuse, nodes={node_names[0]: label}, kv_keys={kv_key}, encoders=False)
    specs = model.get_node_resources()
    for spec in specs:
        if spec.resource_key == kv_key:
            spec.apply_yaml_overrides(max_num_pages=pages, page_size=page_size)
        if spec.resource_key == rope_key and dtype == torch.float32:
            spec.config.rope_dtype = torch.float32
    autocast = None if dtype == torch.float32 else dtype
    lm, *rest = node_names
    nodes = {lm: model.get_submodule(lm, device="cpu", tp_group=CommGroup.trivial(), autocast_dtype=autocast)}
    nodes.update({name: model.get_submodule(name, device="cpu") for name in rest})
    engine = Engine(autocast_dtype=autocast)
    engine.load_model(nodes, specs=specs,
                      parallel_groups=WorkerParallelGroups(num_workers=1, global_rank=0), device=torch.device("cpu"),
                      transfer_engine_info=TransferEngineInfo("e", "s", LocalTransferEngine("h")), kv_cache_type=dtype)
    engine.warmup()
    return engine, nodes


def fwd_info(rid: str, walk: str, configs: dict, step_metadata: dict | None = None) -> CurrentForwardPassInfo:
    return CurrentForwardPassInfo(request_id=rid, graph_walk=walk, fwd_index=0, random_seed=0, max_tokens=1 << 20,
                                  resource_configs=configs, step_metadata=dict(step_metadata or {}))


def run_batch(engine: Engine, node: str, walk: str, inputs: dict[str, dict], configs: dict,
              step_metadata: dict | None = None, metadata_of: dict[str, dict] | None = None) -> ExecutingBatch:
    """One batch of ``node`` on ``walk`` as M*'s worker runs it: ``prepare_inputs``, ``exec_and_postprocess``,
    ``finalize_batch``. ``inputs``: rid -> the node's input tensors by name; ``step_metadata``: what the conductor
    sends every request of the step (Higgs Audio's ``is_last_prefill``), ``metadata_of``: rid -> that request's own
    (the conductor's metadata is per request: Qwen3-Omni's ``is_last_prefill`` differs within a batch). Returns the
    batch: its ``request_ids`` in the order the node ran them, ``inputs`` (what each request's ``prepare_inputs``
    made, after the reuse seam's cut) and ``outputs`` (rid -> its outputs)."""
    metadata_of = metadata_of or {}
    b = ExecutingBatch(node_name=node,
                       per_request_info={rid: fwd_info(rid, walk, configs, metadata_of.get(rid, step_metadata))
                                         for rid in inputs},
                       per_request_input_tensors=inputs,
                       step_context=StepContext(request_ids=tuple(inputs), graph_walk=walk, slot=0, capture=False))
    engine.prepare_inputs(b)
    if b.failed_requests:
        raise RuntimeError(f"{node} {walk}: prepare_inputs failed for {dict(b.failed_requests)}")
    engine.exec_and_postprocess(b)
    engine.finalize_batch(b)
    return b
