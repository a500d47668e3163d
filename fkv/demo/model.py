"""The demo's small transformer: random weights from a fixed seed, tensor parallel by heads.

A decoder-only model (RMSNorm, rotary positions, grouped-query attention, SiLU-gated MLP).
Rank ``r`` of a TP engine of size ``tp`` holds query heads ``[r*Hq/tp, (r+1)*Hq/tp)`` and the
KV heads those use (docs/handshake.md: ``max(1, Hkv // tp)`` per rank, one replicated head when
``tp > Hkv``). Each rank computes attention for its heads only; the head
outputs are all-gathered (concatenated in rank order = head order) and every rank then applies the
full output projection and MLP, so all ranks carry the same residual stream.

Attention is pluggable: :class:`PagedKV` writes K/V with ``fkv.ops.write_kv`` into a paged cache
and reads it with ``fkv.ops.paged_attention`` (prefill and decode ranks); :class:`DenseKV` keeps
plain tensors and computes causal attention in torch (the single-process reference).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from fkv.demo.config import ModelConfig, head_ranges
from fkv.layout import KVCacheSpec

__all__ = ["DemoModel", "DenseKV", "ModelConfig", "PagedKV", "head_ranges"]


def _weights(cfg: ModelConfig) -> dict[str, Any]:
    g = torch.Generator().manual_seed(cfg.seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

    d = cfg.head_size
    out: dict[str, Any] = {"embed": torch.randn(cfg.vocab, cfg.hidden, generator=g),
                           "norm_f": 1 + 0.1 * torch.randn(cfg.hidden, generator=g),
                           "lm_head": w(cfg.hidden, cfg.vocab), "layers": []}
    for _ in range(cfg.num_layers):
        out["layers"].append({
            "norm1": 1 + 0.1 * torch.randn(cfg.hidden, generator=g),
            "wq": w(cfg.hidden, cfg.num_q_heads * d),
            "wk": w(cfg.hidden, cfg.num_kv_heads * d),
            "wv": w(cfg.hidden, cfg.num_kv_heads * d),
            "wo": w(cfg.num_q_heads * d, cfg.hidden),
            "norm2": 1 + 0.1 * torch.randn(cfg.hidden, generator=g),
            "w_gate": w(cfg.hidden, cfg.mlp),
            "w_up": w(cfg.hidden, cfg.mlp),
            "w_down": w(cfg.mlp, cfg.hidden),
        })
    return out


def _rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g


class DemoModel:
    """One rank's shard of the demo model; ``tp=1`` is the whole model.

    ``forward(tokens [T] int64, positions [T] int64, kv) -> logits [T, vocab]`` (float32) where
    ``kv`` is a :class:`PagedKV` or :class:`DenseKV` holding this rank's KV heads.
    ``all_gather(x [T, n]) -> [T, n * tp]`` joins the ranks' head outputs (identity when tp=1).
    """

    def __init__(self, cfg: ModelConfig, *, tp: int = 1, rank: int = 0, device: str = "cpu",
                 all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.cfg, self.tp, self.rank, self.device = cfg, tp, rank, device
        (q_lo, q_hi), (kv_lo, kv_hi) = head_ranges(cfg, tp, rank)
        self.q_heads, self.kv_heads = q_hi - q_lo, kv_hi - kv_lo
        self.all_gather = all_gather or (lambda x: x)
        full = _weights(cfg)
        d = cfg.head_size

        def on(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=torch.float32).contiguous()

        self.embed, self.norm_f = on(full["embed"]), on(full["norm_f"])
        self.lm_head = on(full["lm_head"])
        self.layers = []
        for lw in full["layers"]:
            self.layers.append({
                "norm1": on(lw["norm1"]), "norm2": on(lw["norm2"]), "wo": on(lw["wo"]),
                "wq": on(lw["wq"][:, q_lo * d:q_hi * d]),
                "wk": on(lw["wk"][:, kv_lo * d:kv_hi * d]),
                "wv": on(lw["wv"][:, kv_lo * d:kv_hi * d]),
                "w_gate": on(lw["w_gate"]), "w_up": on(lw["w_up"]), "w_down": on(lw["w_down"]),
            })
        half = d // 2
        self.inv_freq = on(1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ang = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv: Any,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        cfg, d = self.cfg, self.cfg.head_size
        t = tokens.shape[0]
        x = self.embed[tokens]
        for i, lw in enumerate(self.layers):
            h = _rms(x, lw["norm1"])
            q = self._rope((h @ lw["wq"]).view(t, self.q_heads, d), positions)
            k = self._rope((h @ lw["wk"]).view(t, self.kv_heads, d), positions)
            v = (h @ lw["wv"]).view(t, self.kv_heads, d)
            o = kv.attend(i, q, k, v, positions)  # [t, q_heads, d]
            x = x + self.all_gather(o.reshape(t, self.q_heads * d).to(torch.float32)) @ lw["wo"]
            h = _rms(x, lw["norm2"])
            x = x + (torch.nn.functional.silu(h @ lw["w_gate"]) * (h @ lw["w_up"])) @ lw["w_down"]
            if on_layer is not None:
                on_layer(i)
        return _rms(x, self.norm_f) @ self.lm_head


class DenseKV:
    """Reference attention: K/V kept as plain tensors (rounded to the cache dtype), torch math."""

    def __init__(self, num_layers: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        k, v = k.to(self.dtype), v.to(self.dtype)
        prev_k, prev_v = self.k[layer], self.v[layer]
        self.k[layer] = k if prev_k is None else torch.cat([prev_k, k])
        self.v[layer] = v if prev_v is None else torch.cat([prev_v, v])
        keys, values = self.k[layer].to(torch.float32), self.v[layer].to(torch.float32)
        q = q.to(self.dtype).to(torch.float32)  # the paged path feeds q in the cache dtype
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(q.shape[-1])
        key_pos = torch.arange(keys.shape[0], device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > positions[None, :, None], float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), values)
        return out.to(self.dtype)  # like the kernel, which returns q's (the cache's) dtype


class PagedKV:
    """fkv attention for one sequence: ``write_kv`` into ``caches`` then ``paged_attention``.

    ``block_ids`` is the sequence's block table (token ``p`` lives in block
    ``block_ids[p // N]`` slot ``p % N``); it must cover every position written.
    """

    def __init__(self, caches: list[torch.Tensor], spec: KVCacheSpec, block_ids: list[int]) -> None:
        import fkv.ops

        self.ops = fkv.ops
        self.caches, self.spec = caches, spec
        device = caches[0].device
        self.block_ids = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
        self.block_table = self.block_ids.to(torch.int32)[None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        n = self.spec.block_size
        cache_dtype = self.caches[layer].dtype
        slots = self.block_ids[positions // n] * n + positions % n
        self.ops.write_kv(k.to(cache_dtype).contiguous(), v.to(cache_dtype).contiguous(),
                          self.caches[layer], slots, self.spec)
        t = q.shape[0]
        seq_len = int(positions[-1]) + 1
        dev = q.device
        # One query is the decode path (split-K); several are a causal prefill of the last t tokens.
        qsl = None if t == 1 else torch.tensor([0, t], dtype=torch.int32, device=dev)
        return self.ops.paged_attention(
            q.to(cache_dtype).contiguous(), self.caches[layer], self.spec, self.block_table,
            torch.tensor([seq_len], dtype=torch.int32, device=dev), query_start_loc=qsl)
