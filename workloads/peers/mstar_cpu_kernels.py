"""What makes M* (mstar-ai 0.2.1) run on a CPU, for the tests and the M* replays (``workloads.harness.mstar_serving``):
torch stand-ins for exactly the GPU kernels M*'s Orpheus and Higgs Audio LLM forwards reach, so those forwards run on
CPU with every M* class real, and the import-only ``flashinfer`` (``flashinfer_module``) that lets M*'s modules that
import flashinfer at module level load. On a GPU none of this is installed: M*'s own flashinfer and triton kernels run.
Installed from outside M* (``install(patch)`` for a test's monkeypatch, ``installed()`` for a replay), at M*'s own
seams:

- **Paged attention**: ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` and ``BatchDecodeWithPagedKVCacheWrapper``.
  M*'s attention resource (``FlashInferManager``, engine/resources/attn/flashinfer.py) builds them through its own
  ``FlashInferPrefillWrapper``/``FlashInferDecodeWrapper`` (attn/wrappers.py), ``plan``s them with the KV resource's
  page table for the step (``PagedIndptrs``: query offsets, page indices, last-page lengths) and ``run``s them on the
  KV resource's layer tensor. The stand-ins keep that plan and read every K/V row through it: a request attends to
  the pages its stream holds, whoever wrote them (a shared prefix page included), never to a copy of the sequence.
- **RoPE**: ``flashinfer.rope.apply_llama31_rope_pos_ids_inplace``, FlashInfer's llama3.1-scaled RoPE (Orpheus; and
  Higgs Audio's Qwen3, which M*'s attention sends there with factors that make it plain RoPE), and
  ``apply_rope_pos_ids_inplace``, its plain RoPE, called by M*'s
  CUDA kernel of the ``mstar::rope_apply_qk_inplace`` op (position/rope.py) with the positions M*'s ``RopeManager``
  planned. M* registers that op for cuda and xpu only; ``install`` registers the same M* function for CPU, so on CPU
  the op goes through M*'s own dispatch to the flashinfer entry point, which here is the stand-in.
- **Sampling**: ``mstar.engine.resources.sampler.utils.sample_tokens``, which on CUDA runs a triton kernel (penalty,
  temperature, softmax) then flashinfer's sampler, and raises on CPU. The stand-in is greedy only (temperature 0:
  penalized argmax, what the triton kernel's one-hot rows make flashinfer return); a draw at temperature > 0 would
  need flashinfer's RNG and raises. M*'s ``SamplerResource`` and ``Sampler`` stay real (seen-token masks, the
  repetition penalty over ``prefill_tracked_tokens``). It records the logits it is handed (``Sampled``).

Everything else on the path is M*'s and already runs on CPU: embeddings, the fused QKV/gate-up linears, the
``mstar::rms_norm`` op's portable fallback, ``KVManager.write_kv``, planning, positions.

Numerics. The stand-ins compute in fp32 (FlashInfer accumulates in fp32) and return the input dtype. Each query row
is attended alone (its scores, softmax and weighted sum over exactly the keys it sees), so a row's output depends
only on its query and the K/V bytes it reads, not on the other rows of the batch. FlashInfer does not promise that;
the stand-in does, so that reuse on and off can be compared bit for bit. (On CPU, torch's bf16 linears are also row
invariant, fp32 MKL ones are not: the forward runs under bf16 autocast, as M*'s engine serves by default.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import types

import torch


class _ImportOnly(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"{self.__name__}.{name}: the CPU stand-in has no such kernel; nothing else runs here")


def flashinfer_module(name: str = "flashinfer", **kernels) -> types.ModuleType:
    """The flashinfer a CPU imports (flashinfer has no CPU build). With no ``kernels`` it is import-only: Qwen3-Omni's
    ``components/talker.py:18`` imports flashinfer at module level, so ``mstar.model.qwen3_omni.submodules`` (its
    encoder nodes included) cannot be imported without it, and the encoder nodes never call it. ``kernels``: the
    attributes it holds (the torch stand-ins below). Any other attribute read raises, so a kernel reached by mistake
    fails loudly instead of computing something else."""
    m = _ImportOnly(name)
    for attr, value in kernels.items():
        setattr(m, attr, value)
    return m


# -- paged attention --------------------------------------------------------------------------------------------------
def attend_paged(q: torch.Tensor, paged_kv_cache: torch.Tensor, qo_indptr, kv_indptr, kv_indices, last_page_len,
                 causal: bool, sm_scale: float | None = None) -> torch.Tensor:
    """FlashInfer's batched paged attention, one query row at a time. ``q`` [nnz, Hq, D]; ``paged_kv_cache`` the NHD
    layer tensor [pages, 2, page_size, Hkv, D]; request ``i`` owns rows ``qo_indptr[i]:qo_indptr[i+1]`` and pages
    ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, whose last page holds ``last_page_len[i]`` tokens. Causal: the
    queries are the request's last positions, so query ``j`` of ``n`` sees the first ``kv_len - n + j + 1`` keys.
    Query head ``h`` reads KV head ``h // (Hq // Hkv)`` (grouped-query attention)."""
    num_qo_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = paged_kv_cache.shape[2], paged_kv_cache.shape[3]
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{num_qo_heads} query heads over {num_kv_heads} KV heads")
    group = num_qo_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    qo, kvp, pages_of, last = (t.tolist() for t in (qo_indptr, kv_indptr, kv_indices, last_page_len))
    out = torch.empty_like(q)
    for i in range(len(qo) - 1):
        pages = torch.tensor(pages_of[kvp[i]:kvp[i + 1]], dtype=torch.long)
        kv_len = (len(pages) - 1) * page_size + last[i] if len(pages) else 0
        held = paged_kv_cache[pages]  # [n_pages, 2, page_size, Hkv, D]: the stream's own pages, shared ones included
        keys = held[:, 0].reshape(-1, num_kv_heads, head_dim)[:kv_len].float().repeat_interleave(group, dim=1)
        values = held[:, 1].reshape(-1, num_kv_heads, head_dim)[:kv_len].float().repeat_interleave(group, dim=1)
        n = qo[i + 1] - qo[i]
        for j in range(n):
            seen = kv_len - n + j + 1 if causal else kv_len
            row = q[qo[i] + j].float()  # [Hq, D]
            scores = (keys[:seen] * row).sum(-1) * scale  # [seen, Hq]
            weights = scores.softmax(dim=0)
            out[qo[i] + j] = (weights[..., None] * values[:seen]).sum(0).to(q.dtype)
    return out


class _PagedWrapper:
    """What FlashInfer's two paged wrappers share here: built eagerly on the NHD layout (M*'s CPU engine never
    captures a CUDA graph), planned with a page table, run on one layer's pages."""

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto", **buffers):
        if kv_layout != "NHD" or use_cuda_graph:
            raise NotImplementedError(f"{type(self).__name__}: NHD, eager only (got {kv_layout}, "
                                      f"use_cuda_graph={use_cuda_graph})")
        self._plan = None

    def _set_plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                  page_size, causal, q_data_type):
        self._plan = dict(qo_indptr=qo_indptr.cpu(), kv_indptr=kv_indptr.cpu(), kv_indices=kv_indices.cpu(),
                          last_page_len=last_page_len.cpu(), causal=causal)
        self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("run before plan")
        num_qo_heads, num_kv_heads, head_dim, page_size = self._shape
        got = (q.shape[1], paged_kv_cache.shape[3], q.shape[2], paged_kv_cache.shape[2])
        if got != self._shape:
            raise ValueError(f"planned (Hq, Hkv, D, page) {self._shape}, ran with {got}")
        return attend_paged(q, paged_kv_cache, self._plan["qo_indptr"], self._plan["kv_indptr"],
                            self._plan["kv_indices"], self._plan["last_page_len"], self._plan["causal"])


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    """``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` as M*'s ``FlashInferPrefillWrapper`` calls it."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, causal: bool = False, q_data_type=torch.float16):
        self._set_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                       num_kv_heads, head_dim_qk, page_size, causal, q_data_type)


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    """``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` as M*'s ``FlashInferDecodeWrapper`` calls it: one query per
    request, over every key its pages hold."""

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, backend: str = "auto", **buffers):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, **buffers)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             q_data_type=torch.float16):
        n = indptr.shape[0] - 1
        self._set_plan(torch.arange(n + 1, dtype=torch.int32), indptr, indices, last_page_len, num_qo_heads,
                       num_kv_heads, head_dim, page_size, False, q_data_type)


# -- RoPE -------------------------------------------------------------------------------------------------------------
def apply_llama31_rope_pos_ids_inplace(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                                       rotary_dim: int | None = None, interleave: bool = False,
                                       rope_scale: float = 8, rope_theta: float = 5e5, low_freq_factor: float = 1,
                                       high_freq_factor: float = 4, old_context_len: float = 8192) -> None:
    """FlashInfer's llama3.1 RoPE, in place on ``q`` [n, Hq, D] and ``k`` [n, Hkv, D] at positions ``pos_ids``
    [n], in FlashInfer's formulation (pos_enc.cuh): dim ``e``'s frequency ``f = theta^(-2(e mod d/2)/d)`` is blended
    towards ``f / rope_scale`` by ``s = clamp(f * a + b, 0, 1)``, ``a = old_context_len / (2 pi (high - low))``,
    ``b = -1 / (high / low - 1)``, in IEEE float arithmetic as the kernel's host code computes them. M*'s attention
    calls this with ``low = high = 1`` for a model without llama3.1 scaling (Higgs Audio's Qwen3): then ``a = inf``,
    ``b = -inf``, ``s`` is NaN and the kernel's clamp (``fminf``/``fmaxf``, which drop a NaN) makes it 1: plain
    RoPE."""
    if interleave:
        raise NotImplementedError("interleaved RoPE: not on a path the CPU stand-ins serve")
    f32 = torch.float32
    smooth_a = torch.tensor(old_context_len, dtype=f32) / torch.tensor(
        2 * math.pi * high_freq_factor - 2 * math.pi * low_freq_factor, dtype=f32)
    smooth_b = torch.tensor(-1.0, dtype=f32) / torch.tensor(high_freq_factor / low_freq_factor - 1.0, dtype=f32)
    freq = rope_frequencies(rotary_dim or q.shape[-1], rope_theta, rope_scale, smooth_a, smooth_b)
    rotate_halves(q, k, pos_ids, freq)


def apply_rope_pos_ids_inplace(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                               rotary_dim: int | None = None, interleave: bool = False, rope_scale: float = 1,
                               rope_theta: float = 1e4) -> None:
    """FlashInfer's plain RoPE, in place: the kernel above with ``a = b = 0`` (every frequency ``f / rope_scale``)."""
    if interleave:
        raise NotImplementedError("interleaved RoPE: not on a path the CPU stand-ins serve")
    zero = torch.tensor(0.0)
    rotate_halves(q, k, pos_ids, rope_frequencies(rotary_dim or q.shape[-1], rope_theta, rope_scale, zero, zero))


def rope_frequencies(d: int, rope_theta: float, rope_scale: float, smooth_a: torch.Tensor,
                     smooth_b: torch.Tensor) -> torch.Tensor:
    """The kernel's per-dim frequency [d], fp32: ``f = theta^(-2(e mod d/2)/d)``, ``s = fmax(0, fmin(1, f a + b))``,
    ``(1 - s) f / rope_scale + s f``."""
    e = torch.arange(d, dtype=torch.float32)
    freq = (1.0 / rope_theta) ** ((2 * (e % (d // 2))) / d)
    smooth = torch.fmax(torch.tensor(0.0), torch.fmin(torch.tensor(1.0), freq * smooth_a + smooth_b))
    return (1 - smooth) * (freq / rope_scale) + smooth * freq


def rotate_halves(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, freq: torch.Tensor) -> None:
    """Rotate the first ``freq.numel()`` dims of ``q`` and ``k`` as halves ("rotate_half") by ``pos * freq``, in
    fp32, stored back in the input dtype."""
    d = freq.numel()
    angle = pos_ids.to(torch.float32)[:, None] * freq[None, :]  # [n, d]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    for x in (q, k):
        r = x[..., :d].float()
        rotated = torch.cat((-r[..., d // 2:], r[..., :d // 2]), dim=-1)
        x[..., :d] = (r * cos + rotated * sin).to(x.dtype)


# -- sampling ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sampled:
    """What the sampling stand-in was handed, one entry per ``sample_tokens`` call: the logits [B, V] (as the LM
    head produced them, before the penalty) and the tokens it picked, rows in the order M*'s sampler passed them.
    ``keep_logits=False`` (a long replay) keeps only the tokens; ``logits`` then stays empty."""

    logits: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    keep_logits: bool = True


def greedy_sample_tokens(record: Sampled):
    """``sample_tokens`` for greedy requests: the repetition penalty on seen tokens as the triton kernel applies it
    (``x / p`` where ``x > 0``, else ``x * p``), then the first argmax; int32 like flashinfer's samplers."""

    def sample_tokens(logits, temperature=0.6, top_k=0, top_p=1.0, repetition_penalty=1.0, seen_token_mask=None,
                      any_greedy=None, any_top_k_zero=None, all_top_k_zero=None, seed=None, rand_offset=None):
        temperature = torch.as_tensor(temperature).reshape(-1)
        if bool((temperature != 0).any()):
            raise NotImplementedError("the CPU sampling stand-in is greedy only (temperature 0): a draw at "
                                      "temperature > 0 needs flashinfer's RNG")
        vals = logits.float()
        if seen_token_mask is not None:
            penalty = torch.as_tensor(repetition_penalty, dtype=torch.float32).reshape(-1, 1)
            vals = torch.where(seen_token_mask, torch.where(vals > 0, vals / penalty, vals * penalty), vals)
        tokens = vals.argmax(dim=-1).to(torch.int32)
        if record.keep_logits:
            record.logits.append(logits.detach().clone())
        record.tokens.append(tokens.clone())
        return tokens

    return sample_tokens


# -- installing them --------------------------------------------------------------------------------------------------
def kernels_module():
    """The flashinfer module the stand-ins make: the two paged wrappers and ``rope``; any other attribute raises."""
    rope = flashinfer_module("flashinfer.rope", apply_llama31_rope_pos_ids_inplace=apply_llama31_rope_pos_ids_inplace,
                             apply_rope_pos_ids_inplace=apply_rope_pos_ids_inplace)
    return flashinfer_module(BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
                             BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper, rope=rope)


_ROPE_ON_CPU = {"registered": False, "module": None}  # the kernels module the last ``install`` put in


def _register_rope_on_cpu() -> None:
    """Give M*'s RoPE op a CPU kernel: M*'s own CUDA kernel function (it calls flashinfer's rope), taken only while
    ``install``'s flashinfer is imported; otherwise the op raises on CPU as M* ships it. Process-wide, once."""
    if _ROPE_ON_CPU["registered"]:
        return
    from mstar.engine.resources.position import rope

    def on_cpu(q, k, pos_ids, cos_sin_cache, rotary_dim, interleave, rope_scale, rope_theta,
               low_freq_factor=None, high_freq_factor=None, old_context_len=None):
        if sys.modules.get("flashinfer") is not _ROPE_ON_CPU["module"]:
            raise NotImplementedError(f"RoPE is only implemented for CUDA and XPU, not {q.device.type}")
        rope._rope_apply_qk_inplace_cuda(q, k, pos_ids, cos_sin_cache, rotary_dim, interleave, rope_scale,
                                         rope_theta, low_freq_factor, high_freq_factor, old_context_len)

    rope.rope_apply_qk_inplace.register_kernel("cpu")(on_cpu)
    _ROPE_ON_CPU["registered"] = True


def install(patch, keep_logits: bool = True) -> Sampled:
    """Put the stand-ins in through ``patch`` (a test's ``monkeypatch``, or ``installed``'s undoable patch; either
    undoes it): ``flashinfer`` in ``sys.modules`` is the kernels module, M*'s RoPE op runs on CPU through it, M*'s
    sampler draws greedily through the stand-in, and FlashInfer's workspace buffers (unused here) are 1 MiB. Returns
    what the sampler is handed."""
    module = _ROPE_ON_CPU["module"] = kernels_module()
    patch.setitem(sys.modules, "flashinfer", module)
    patch.setenv("MSTAR_WORKSPACE_BUFFER_MB", "1")
    _register_rope_on_cpu()
    from mstar.engine.resources.sampler import utils as sampler_utils

    record = Sampled(keep_logits=keep_logits)
    patch.setattr(sampler_utils, "sample_tokens", greedy_sample_tokens(record))
    return record


class _Undo:
    """``setitem``/``setenv``/``setattr`` as pytest's monkeypatch has them, each undone, last first, by ``undo``."""

    def __init__(self):
        self._undo = []

    def setitem(self, mapping, key, value):
        old = mapping.get(key, _MISSING)
        self._undo.append(lambda: mapping.pop(key, None) if old is _MISSING else mapping.__setitem__(key, old))
        mapping[key] = value

    def setenv(self, name, value):
        self.setitem(os.environ, name, value)

    def setattr(self, obj, name, value):
        old = getattr(obj, name)
        self._undo.append(lambda: setattr(obj, name, old))
        setattr(obj, name, value)

    def undo(self):
        while self._undo:
            self._undo.pop()()


_MISSING = object()


@contextlib.contextmanager
def installed(keep_logits: bool = False):
    """``install`` for the length of a ``with`` block (a replay on a CPU machine); yields the sampler's record."""
    patch = _Undo()
    try:
        yield install(patch, keep_logits)
    finally:
        patch.undo()
