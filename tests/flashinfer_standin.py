"""A CPU stand-in for the few flashinfer calls M*'s cache manager makes (the paged prefill/decode wrappers' ``plan``
and ``run``, ``rope.apply_rope_pos_ids_inplace``); flashinfer has no CPU build. Installed as ``sys.modules
["flashinfer"]`` by the tests that drive M*'s cache manager, and checked against dense attention there.

Attention is computed per request in float32 over the pages the plan names, so a request's output never depends on
the other requests in its batch."""

import types

import torch


class _Paged:
    def __init__(self, workspace=None, layout="NHD", **_):
        assert layout == "NHD"
        self.plan_args = None

    def _plan(self, qo_indptr, indptr, indices, last_page_len, page_size, causal):
        self.qo = qo_indptr.tolist()
        self.indptr, self.indices = indptr.tolist(), indices.tolist()
        self.last, self.page_size, self.causal = last_page_len.tolist(), page_size, causal

    def run(self, q, kv_cache_layer):
        """q: [tokens, qo_heads, D]; kv_cache_layer: [pages, 2, P, kv_heads, D]."""
        out = torch.empty(q.shape, dtype=torch.float32)
        for i in range(len(self.indptr) - 1):
            pages = self.indices[self.indptr[i]:self.indptr[i + 1]]
            n_kv = (len(pages) - 1) * self.page_size + self.last[i]
            kv = kv_cache_layer[pages].float()  # [n, 2, P, H, D]
            k = kv[:, 0].reshape(-1, *kv.shape[-2:])[:n_kv]
            v = kv[:, 1].reshape(-1, *kv.shape[-2:])[:n_kv]
            lo, hi = self.qo[i], self.qo[i + 1]
            qi = q[lo:hi].float()
            rep = qi.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", qi, k) / qi.shape[-1] ** 0.5
            if self.causal:
                pos_q = torch.arange(n_kv - (hi - lo), n_kv)[:, None]
                scores = scores.masked_fill(torch.arange(n_kv)[None, :] > pos_q, float("-inf"))
            out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out.to(q.dtype)


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, causal=True, q_data_type=None, **_):
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, causal)


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             q_data_type=None, **_):
        n = len(indptr) - 1
        self._plan(torch.arange(n + 1), indptr, indices, last_page_len, page_size, True)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0,
                               rope_theta=1e4):
    """Non-interleaved (NeoX) RoPE over the whole head, in place."""
    d = q.shape[-1]
    inv = 1.0 / rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = (pos_ids.float() / rope_scale)[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    for x in (q, k):
        a, b = x[..., : d // 2].float(), x[..., d // 2:].float()
        x.copy_(torch.cat((a * cos - b * sin, b * cos + a * sin), -1).to(x.dtype))


def module() -> types.ModuleType:
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    fi.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    fi.rope = types.SimpleNamespace(apply_rope_pos_ids_inplace=apply_rope_pos_ids_inplace)
    return fi
