"""Helpers for the tests that run M*'s own encoder submodules under its StatelessEngine on the CPU: tiny random
models saved and loaded back through ``workloads.fixtures.saved``, batches as M*'s worker builds them, and forward
counters (hooks on the HF encoder inside the node, so the node itself runs unchanged)."""

import sys
from pathlib import Path

import torch

from mstar_helpers import require_mstar

__all__ = ["require_mstar"]


def install_flashinfer_standin(monkeypatch):
    """Qwen3-Omni's talker.py imports flashinfer at module level; flashinfer has no CPU build."""
    sys.path.insert(0, str(Path(__file__).parent))
    import flashinfer_standin
    if "flashinfer" not in sys.modules:
        monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin.module())


def saved_model(folder_root, kind: str, config, cls):
    """``cls.from_pretrained`` of a ``cls(config)`` with random weights saved once under ``folder_root``."""
    from workloads import fixtures
    folder = fixtures.saved(folder_root, kind, config.to_json_string(), lambda f: cls(config).save_pretrained(f))
    return cls.from_pretrained(folder).eval()


def engine(submodules: dict, autocast=None):
    """M*'s StatelessEngine on the CPU with ``submodules`` loaded."""
    from mstar.distributed.communication import WorkerParallelGroups
    from mstar.engine.stateless_engine import StatelessEngine, StatelessEngineConfig
    eng = StatelessEngine(StatelessEngineConfig(autocast_dtype=autocast, name="test"))
    eng.load_model(submodules, parallel_groups=WorkerParallelGroups(num_workers=1, global_rank=0),
                   device=torch.device("cpu"))
    eng.warmup()
    return eng


def batch(node: str, walk: str, requests: dict, step_metadata: dict | None = None):
    """A NodeBatch of ``requests`` (rid -> {input name: [tensors]}) as M*'s worker hands it to an engine."""
    from mstar.conductor.request_info import CurrentForwardPassInfo
    from mstar.engine.base import NodeBatch
    infos = {rid: CurrentForwardPassInfo(request_id=rid, graph_walk=walk, requires_cfg=False, fwd_index=0,
                                         random_seed=0, max_tokens=1, sampling_config={},
                                         step_metadata=dict(step_metadata or {}))
             for rid in requests}
    return NodeBatch(node_name=node, graph_walk=walk, request_ids=list(requests),
                     per_request_input_tensors=dict(requests), per_request_info=infos)


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
