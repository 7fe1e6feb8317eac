"""A tiny autoregressive model over M*'s cache manager (plan_attention, plan_rope, apply_rope, run_attention,
advance_seq_lens): the model of the tests and benchmarks that drive M*'s own code on the CPU."""

import torch

import flashinfer_standin

L, H, D, V, P = 2, 2, 8, 61, 4
CPU = torch.device("cpu")


def lin(x, w):
    """A batch-invariant linear layer (elementwise product and a per-row sum), so a token's result never depends
    on which other tokens share its batch."""
    return (x[:, None, :] * w[None]).sum(-1)


class TinyAR:
    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
        self.emb = r(V, H * D)
        self.layers = [(r(H * D, H * D), r(H * D, H * D), r(H * D, H * D), r(H * D, H * D)) for _ in range(L)]
        self.out = r(V, H * D)

    def step(self, alloc, batch: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One engine step through M*'s cache manager: each request appends ``batch[rid]``; returns its logits."""
        from mstar.engine.cache_manager import WorkspaceBufferManager, create_cache_manager
        rids = list(batch)
        cm = create_cache_manager(request_ids=rids, active_labels_per_request=dict.fromkeys(rids, "main"),
                                  kv_cache=alloc.kv_cache, alloc_manager=alloc,
                                  buffer_manager=WorkspaceBufferManager(1024, CPU), kv_cache_config=alloc.config,
                                  device=CPU, auto_write_store=False)
        return dict(zip(rids, self.forward(cm, list(batch.values()))))

    def forward(self, cm, ids: list) -> torch.Tensor:
        """Append ``ids[i]`` to the i-th request of ``cm``; the logits of each one's last token, [B, V]."""
        lens = [len(t) for t in ids]
        cm.plan_attention(seq_lens=lens, dtype=torch.float32)
        cm.plan_rope(lens)
        x = self.emb[torch.tensor([int(t) for seq in ids for t in seq])]
        for layer, (wq, wk, wv, wo) in enumerate(self.layers):
            q, k, v = (lin(x, w).view(-1, H, D) for w in (wq, wk, wv))
            q, k = cm.apply_rope(q, k, rope_dtype=torch.float32)
            x = x + lin(cm.run_attention(q, k, v, layer_idx=layer).reshape(-1, H * D), wo)
        cm.advance_seq_lens()
        logits = lin(x, self.out)
        return logits[torch.tensor(lens).cumsum(0) - 1]

    def dense(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position by plain causal attention over the whole sequence (no pages)."""
        x = self.emb[torch.tensor(tokens)]
        pos = torch.arange(len(tokens))
        for wq, wk, wv, wo in self.layers:
            q, k, v = (lin(x, w).view(-1, H, D) for w in (wq, wk, wv))
            flashinfer_standin.apply_rope_pos_ids_inplace(q, k, pos)
            a = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                                 v.transpose(0, 1), is_causal=True)
            x = x + lin(a.transpose(0, 1).reshape(-1, H * D), wo)
        return lin(x, self.out)


