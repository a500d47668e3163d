"""Reference ``paged_attention``: pure torch/einops, float32 accumulation, slow and obvious.

Same signature and checks as :func:`fkv.ops.paged_attention`. :func:`attend` does the work in any
accumulation dtype (tests use float64) and returns that dtype.
"""

from __future__ import annotations

from typing import Any

import einops
import torch

from fkv.layout import KVCacheSpec
from fkv.errors import field_error
from fkv.ops._spec import check_pdl, check_scale_values, check_validate
from fkv.ops.attention import (check_attention_inputs, check_attention_values,
                               check_finite_per_head)

__all__ = ["attend", "paged_attention"]

_QUERY_CHUNK = 1024  # queries per score matrix (bounds memory for long prefills)


def _keys_values(cache: torch.Tensor, spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``[NB, N, H, D]`` views, whatever the backend and layout."""
    axes = " ".join(spec.logical_axes)
    if "two" in spec.logical_axes:
        kv = einops.rearrange(cache, f"{axes} -> two B N H C")
        return kv[0], kv[1]
    latent = einops.rearrange(cache, f"{axes} -> B N 1 C")  # MLA: the latent is key and value
    return latent, latent


def _scale_value(x: Any, dtype: torch.dtype) -> float:
    return float(x.reshape(()).to(dtype).item()) if isinstance(x, torch.Tensor) else float(x)


def attend(q: torch.Tensor, cache: torch.Tensor, spec: KVCacheSpec, block_table: torch.Tensor,
           seq_lens: torch.Tensor, *, query_start_loc: torch.Tensor | None = None,
           scale: float | None = None, sliding_window: int | None = None,
           softcap: float | None = None, k_scale: Any = None, v_scale: Any = None,
           acc_dtype: torch.dtype = torch.float32, alibi_slopes: Any = None,
           sinks: Any = None) -> torch.Tensor:
    """Paged attention computed in ``acc_dtype``; returns ``[T, Hq, D]`` in ``acc_dtype``.

    >>> import torch, fkv
    >>> spec = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8,
    ...                        dtype="float32")
    >>> (cache,) = fkv.allocate(spec)
    >>> _ = cache.copy_(torch.randn(cache.shape))
    >>> q = torch.randn(1, 2, 8)
    >>> bt, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    >>> o = attend(q, cache, spec, bt, lens, acc_dtype=torch.float64)   # one key: output = V[0]
    >>> torch.allclose(o[0, 0], cache[1, 1, 0, 0].double())
    True
    """
    prob = check_attention_inputs(q, cache, spec, block_table, seq_lens,
                                  query_start_loc=query_start_loc, scale=scale,
                                  sliding_window=sliding_window, softcap=softcap,
                                  k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                                  sinks=sinks)
    check_attention_values(spec, block_table, seq_lens, query_start_loc, prob.num_q_tokens)
    check_finite_per_head(alibi_slopes=alibi_slopes, sinks=sinks)
    slopes = None if alibi_slopes is None else alibi_slopes.to(acc_dtype)[:, None, None]
    sink = None if sinks is None else sinks.to(acc_dtype)[:, None, None]
    if spec.is_fp8:  # floats were checked above; tensors' values here, as the kernel validates
        check_scale_values(**{name: s for name, s in (("k_scale", k_scale), ("v_scale", v_scale))
                              if isinstance(s, torch.Tensor)})
    keys, values = _keys_values(cache, spec)
    ks = _scale_value(k_scale, acc_dtype) if spec.is_fp8 else 1.0
    vs = _scale_value(v_scale, acc_dtype) if spec.is_fp8 else 1.0
    n, group = spec.block_size, prob.group
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist() if query_start_loc is not None else list(range(prob.num_seqs + 1))
    out = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
    for b in range(prob.num_seqs):
        length, q_lo, q_hi = lens[b], starts[b], starts[b + 1]
        if q_hi == q_lo:
            continue
        blocks = block_table[b, : -(-length // n)].to(torch.int64)
        k = keys[blocks].reshape(-1, *keys.shape[2:])[:length].to(acc_dtype) * ks   # [L, Hkv, D]
        v = values[blocks].reshape(-1, *values.shape[2:])[:length].to(acc_dtype) * vs
        k = k.repeat_interleave(group, dim=1)                                        # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        key_pos = torch.arange(length, device=q.device)
        for c_lo in range(q_lo, q_hi, _QUERY_CHUNK):
            c_hi = min(c_lo + _QUERY_CHUNK, q_hi)
            qc = q[c_lo:c_hi].to(acc_dtype)                                          # [n, Hq, D]
            s = torch.einsum("qhd,khd->hqk", qc, k) * prob.scale
            if prob.softcap is not None:
                s = prob.softcap * torch.tanh(s / prob.softcap)
            pos = length - (q_hi - q_lo) + torch.arange(c_lo - q_lo, c_hi - q_lo, device=q.device)
            if slopes is not None:  # ALiBi: slope x (key position - query position)
                s = s + slopes * (key_pos[None, :] - pos[:, None]).to(acc_dtype)
            visible = key_pos[None, :] <= pos[:, None]
            if prob.window is not None:
                visible &= key_pos[None, :] > pos[:, None] - prob.window
            s = s.masked_fill(~visible, float("-inf"))
            if sink is not None:  # one more logit per head, whose value is zero: dropped after
                s = torch.cat([s, sink.expand(-1, s.shape[1], 1)], dim=-1)
                p = torch.softmax(s, dim=-1)[..., :-1]
            else:
                p = torch.softmax(s, dim=-1)
            out[c_lo:c_hi] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def paged_attention(q: torch.Tensor, cache: torch.Tensor, spec: KVCacheSpec,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                    query_start_loc: torch.Tensor | None = None, scale: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    k_scale: Any = None, v_scale: Any = None,
                    out: torch.Tensor | None = None, validate: bool | None = None,
                    config: Any = None, pdl: bool = False, alibi_slopes: Any = None,
                    sinks: Any = None) -> torch.Tensor:
    """Reference of :func:`fkv.ops.paged_attention` (float32 accumulation), same signature.

    ``validate``, ``config`` and ``pdl`` are checked as the kernel checks them and change nothing
    here: the reference always checks the values it indexes with (it cannot mask a bad block id),
    has no tiles to configure and launches no kernel.

    >>> import torch, fkv
    >>> spec = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8,
    ...                        dtype="float32")
    >>> (cache,) = fkv.allocate(spec)
    >>> _ = cache.copy_(torch.randn(cache.shape))
    >>> q = torch.randn(3, 2, 8)                                  # prefill of 3 tokens
    >>> qsl = torch.tensor([0, 3], dtype=torch.int32)
    >>> paged_attention(q, cache, spec, torch.tensor([[1, 0]], dtype=torch.int32),
    ...                 torch.tensor([5], dtype=torch.int32), query_start_loc=qsl).shape
    torch.Size([3, 2, 8])
    """
    from fkv.ops.attention import AttentionConfig

    check_attention_inputs(q, cache, spec, block_table, seq_lens, query_start_loc=query_start_loc,
                           scale=scale, sliding_window=sliding_window, softcap=softcap,
                           k_scale=k_scale, v_scale=v_scale, out=out, alibi_slopes=alibi_slopes,
                           sinks=sinks)
    if config is not None and not isinstance(config, AttentionConfig):
        raise field_error("config", config, "an AttentionConfig or None")
    check_pdl(pdl)
    check_validate(validate)
    res = attend(q, cache, spec, block_table, seq_lens, query_start_loc=query_start_loc,
                 scale=scale, sliding_window=sliding_window, softcap=softcap,
                 k_scale=k_scale, v_scale=v_scale, acc_dtype=torch.float32,
                 alibi_slopes=alibi_slopes, sinks=sinks)
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out
