"""The demo's verdict: generated tokens, logits and transferred KV against the reference (numpy)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Verdict", "compare_kv", "compare_run", "tolerance"]


def tolerance(dtype: str) -> tuple[float, float]:
    """``(rtol, atol)`` for logits and KV values: float32 caches agree to rounding noise; 16-bit
    caches round the attention output too, so they get a looser bound."""
    return (1e-4, 1e-4) if dtype == "float32" else (5e-2, 5e-2)


class Verdict(dict):
    """``{"ok", "tokens_identical", "logits_max_abs_diff", "logits_ok", "kv_max_abs_diff", "kv_ok",
    "first_divergence", "rtol", "atol"}`` (a plain dict, JSON-ready)."""


def compare_kv(ref: np.ndarray, got: np.ndarray, heads: tuple[int, int], rtol: float,
               atol: float) -> tuple[float, str | None]:
    """Max |diff| and the first mismatch of a decode rank's received KV against the reference.

    ``ref`` is ``[L, T, 2, H_total, D]``; ``got`` is ``[L, T, 2, h, D]`` for heads ``heads``.
    NaN in ``got`` (the poison the caches start with) means a value that never arrived.
    """
    want = ref[:, :, :, heads[0]:heads[1]]
    if want.shape != got.shape:
        return float("inf"), f"received KV has shape {got.shape}, expected {want.shape}"
    bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
    diff = np.abs(got.astype(np.float64) - want)
    worst = float(np.nanmax(diff)) if np.isfinite(diff).any() else float("inf")
    if np.isnan(got).any():
        worst = float("inf")
    if not bad.any():
        return worst, None
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    layer, tok, kv, head, ch = at
    return worst, (f"KV after transfer differs first at layer {layer}, token {tok}, {'KV'[kv]}, "
                   f"head {heads[0] + head}, channel {ch}: received {float(got[at])!r}, "
                   f"reference {float(want[at])!r} ({int(bad.sum())} of {bad.size} values differ)")


def compare_run(ref_tokens: list[int], ref_logits: list[np.ndarray], tokens: list[int],
                logits: list[np.ndarray], kv_checks: list[tuple[float, str | None]],
                dtype: str, prompt_len: int) -> Verdict:
    """Compare generated tokens (identical) and logits (within ``tolerance(dtype)``) step by step."""
    rtol, atol = tolerance(dtype)
    first: str | None = None
    max_diff = 0.0
    logits_ok = len(logits) == len(ref_logits)
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        d = float(np.max(np.abs(a.astype(np.float64) - b))) if np.isfinite(a).all() else float("inf")
        max_diff = max(max_diff, d)
        close = bool(np.allclose(a, b, rtol=rtol, atol=atol))
        logits_ok &= close
        where = f"step {step} (position {prompt_len + step - 1}, {'prefill' if step == 0 else 'decode'})"
        if first is None and (step >= len(tokens) or step >= len(ref_tokens)
                              or tokens[step] != ref_tokens[step]):
            got = tokens[step] if step < len(tokens) else None
            want = ref_tokens[step] if step < len(ref_tokens) else None
            first = f"{where}: generated token {got}, reference {want}"
        if first is None and not close:
            i = int(np.argmax(np.abs(a.astype(np.float64) - b)))
            first = (f"{where}: logits differ by up to {d:.3g} (token {i}: {a[i]:.6g} vs "
                     f"reference {b[i]:.6g}; tolerance rtol={rtol}, atol={atol})")
    identical = bool(tokens) and tokens == ref_tokens
    if first is None and not identical:
        first = f"generated {len(tokens)} tokens, reference {len(ref_tokens)}"
    kv_max = max((d for d, _ in kv_checks), default=0.0)
    kv_first = next((msg for _, msg in kv_checks if msg), None)
    kv_ok = kv_first is None and bool(kv_checks)
    if kv_first and first is None:
        first = kv_first
    elif kv_first:
        first = f"{kv_first}; then {first}"
    return Verdict(ok=identical and logits_ok and kv_ok, tokens_identical=identical,
                   logits_max_abs_diff=max_diff, logits_ok=logits_ok, kv_max_abs_diff=kv_max,
                   kv_ok=kv_ok, first_divergence=first, rtol=rtol, atol=atol)
