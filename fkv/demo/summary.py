"""The demo's summary: one dict (written by ``--json``) and the rich table printed from it."""

from __future__ import annotations

import math
from typing import Any

import attrs
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from fkv.demo.config import DemoConfig

__all__ = ["print_reject", "print_summary", "summary_dict"]


def _engine_text(cfg: DemoConfig, side: str) -> str:
    spec = cfg.spec(side)
    tp = cfg.prefill_tp if side == "prefill" else cfg.decode_tp
    return (f"TP={tp} ({tp} process{'es' if tp > 1 else ''}), {spec.backend} {spec.layout.value}, "
            f"block {spec.block_size}, {spec.num_kv_heads} KV head(s)/rank, {spec.dtype}")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def summary_dict(cfg: DemoConfig, handshakes: list[Any], state: dict[str, Any] | None,
                 verdict: dict[str, Any] | None, errors: list[dict[str, Any]] | None, *,
                 exit_code: int) -> dict[str, Any]:
    """Everything the summary table shows, JSON-ready."""
    first = handshakes[0]
    hs: dict[str, Any] = {"decision": "accept" if all(h.ok for h in handshakes) else "reject"}
    if hs["decision"] == "accept":
        hs["strategy"] = first.plan.strategy
        hs["plans"] = [h.plan.describe() for h in handshakes]
    else:
        rejected = next(h for h in handshakes if not h.ok)
        hs["reasons"] = [{"code": r.code, "path": r.path, "local": repr(r.local),
                          "remote": repr(r.remote), "message": r.message, "fix": r.fix}
                         for r in rejected.reasons]
    out: dict[str, Any] = {
        "config": {k: v for k, v in attrs.asdict(cfg).items()
                   if k != "model" and (k != "stream" or cfg.stream)},
        "model": attrs.asdict(cfg.model),
        "prefill": {"engine": _engine_text(cfg, "prefill"), "spec": repr(cfg.spec("prefill"))},
        "decode": {"engine": _engine_text(cfg, "decode"), "spec": repr(cfg.spec("decode"))},
        "handshake": hs,
        "exit_code": exit_code,
    }
    if state is None:
        return out
    transfers = [state["transfers"][r] for r in sorted(state["transfers"])]
    out["transfer"] = {
        "ok": len(transfers) == cfg.decode_tp and all(t["ok"] for t in transfers),
        "bytes": sum(t["bytes"] for t in transfers),
        "descriptors": sum(t["descriptors"] for t in transfers),
        "seconds": max((t["seconds"] for t in transfers), default=None),
        "nixl_seconds": max((t["nixl_seconds"] for t in transfers), default=None),
        "moved_by": " and ".join(sorted({t.get("moved_by") or "NIXL" for t in transfers}))
        or "NIXL",
        "per_rank": [{k: t.get(k) for k in ("rank", "ok", "bytes", "descriptors", "seconds",
                                            "nixl_seconds", "path", "moved_by", "stats",
                                            "error")}
                     for t in transfers],
    }
    if cfg.stream:
        out["stream"] = _stream_dict(cfg, state, transfers)
    out["tokens"] = {"prompt": cfg.tokens, "new": cfg.new_tokens,
                     "generated": state.get("tokens", []), "reference": state.get("ref_tokens", [])}
    assert verdict is not None
    out["verification"] = {**verdict,
                           "logits_max_abs_diff": _finite(verdict["logits_max_abs_diff"]),
                           "kv_max_abs_diff": _finite(verdict["kv_max_abs_diff"])}
    out["errors"] = [{k: v for k, v in e.items() if v is not None} for e in errors or []]
    out["wall_seconds"] = state.get("wall_seconds")
    return out


def _stream_dict(cfg: DemoConfig, state: dict[str, Any],
                 transfers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """--stream: the streamed and the non-streamed read of the same request, timed from the
    prefill's last layer (perf_counter on one host: comparable across the demo's processes).

    ``tail_seconds``: the last layer's publish (latest prefill rank) -> the complete KV at
    decode (slowest rank). The non-streamed read can only start after the last layer, so its
    tail is its read time (slowest rank). ``layers``: when each layer was published (latest
    prefill rank) and landed (slowest decode rank), from the forward's start, and the gap."""
    prefill = [state.get("prefill_ranks", {})[r] for r in sorted(state.get("prefill_ranks", {}))]
    L = cfg.model.num_layers
    if (len(prefill) != cfg.prefill_tp or len(transfers) != cfg.decode_tp
            or any(len(p.get("published") or []) != L for p in prefill)
            or any(not t.get("ok") or len(t.get("landed") or []) != L for t in transfers)):
        return None
    t0 = min(p["forward_start"] for p in prefill)
    pub = [max(p["published"][i] for p in prefill) for i in range(L)]
    land = [max(t["landed"][i] for t in transfers) for i in range(L)]
    plain = [t["plain"] for t in transfers]
    plain_ok = all(p["ok"] for p in plain)
    return {
        "prefill_forward_seconds": max(p["seconds"] for p in prefill),
        "streamed": {"tail_seconds": max(t["completed"] for t in transfers) - pub[-1],
                     "read_seconds": max(t["seconds"] for t in transfers)},
        "non_streamed": {"ok": plain_ok,
                         "tail_seconds": max(p["seconds"] for p in plain) if plain_ok else None,
                         "bytes": sum(p["bytes"] for p in plain),
                         "errors": [p["error"] for p in plain if p.get("error")]},
        "identical": all(t.get("plain_equal") is True for t in transfers),
        "layers": [{"layer": i, "published_seconds": pub[i] - t0, "landed_seconds": land[i] - t0,
                    "after_publish_seconds": land[i] - pub[i]} for i in range(L)],
    }


def _stream_rows(table: Table, st: dict[str, Any] | None) -> None:
    if st is None:
        table.add_row("streaming", "[red]incomplete[/] (a streamed or non-streamed read failed)")
        return
    s_tail, p_tail = st["streamed"]["tail_seconds"], st["non_streamed"]["tail_seconds"]
    ratio = "" if not p_tail or s_tail <= 0 else f" ({p_tail / s_tail:.1f}x shorter streamed)"
    table.add_row("last layer -> KV",
                  f"streamed [bold]{s_tail * 1e3:.2f} ms[/], non-streamed "
                  f"[bold]{'n/a' if p_tail is None else f'{p_tail * 1e3:.2f} ms'}[/]{ratio} "
                  f"(prefill's last layer published -> complete KV at decode, slowest rank)")
    same = "[green]identical[/]" if st["identical"] else "[red]DIFFER[/]"
    table.add_row("  same KV", f"streamed and non-streamed reads {same}; prefill forward "
                  f"{st['prefill_forward_seconds'] * 1e3:.1f} ms")
    for row in st["layers"]:
        table.add_row(f"  layer {row['layer']}",
                      f"published at {row['published_seconds'] * 1e3:.1f} ms into the forward, "
                      f"landed +{row['after_publish_seconds'] * 1e3:.2f} ms after its publish")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2g}"


def print_summary(console: Console, s: dict[str, Any]) -> None:
    table = Table(title="fkv demo", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    m = s["model"]
    table.add_row("model", f"{m['num_layers']} layers, {m['num_q_heads']} query / "
                  f"{m['num_kv_heads']} KV heads of {m['head_size']}, hidden {m['hidden']}, "
                  f"vocab {m['vocab']} (seed {m['seed']})")
    table.add_row("prefill", s["prefill"]["engine"])
    table.add_row("decode", s["decode"]["engine"])
    hs = s["handshake"]
    table.add_row("handshake", f"[green]Accept[/], strategy [bold]{hs['strategy']}[/]"
                  if hs["decision"] == "accept" else "[red]Reject[/]")
    t = s.get("transfer")
    if t:
        status = "[green]ok[/]" if t["ok"] else "[red]FAILED[/]"
        what = "streamed read (from before the forward)" if "stream" in s else "read"
        secs = "n/a" if t["seconds"] is None else (
            f"{what} {t['seconds'] * 1e3:.1f} ms, of which {t.get('moved_by', 'NIXL')} "
            f"{t['nixl_seconds'] * 1e3:.1f} ms "
            "(slowest rank)")
        table.add_row("transfer", f"{status}: {t['bytes']:,} bytes in {t['descriptors']:,} descriptors "
                      f"over {len(t['per_rank'])} read(s); {secs}")
        for r in t["per_rank"]:
            st = r.get("stats") or {}
            if st:
                gbps = st.get("gbps")
                table.add_row(f"  rank {r['rank']} stats",
                              f"path {r.get('path')}, {st.get('reads', 0)} read(s), failures "
                              f"{st.get('failures') or 'none'}"
                              + ("" if gbps is None else f", {gbps:.3g} GB/s"))
    if "stream" in s:
        _stream_rows(table, s["stream"])
    tok = s.get("tokens")
    if tok:
        table.add_row("tokens", f"prompt {tok['prompt']}, generated {len(tok['generated'])}: "
                      f"{tok['generated']}")
    v = s.get("verification")
    if v and s.get("errors"):
        table.add_row("verification", "[red]FAIL[/]: the run did not complete (see the errors below)")
    elif v:
        mark = "[green]PASS[/]" if v["ok"] and not s.get("errors") else "[red]FAIL[/]"
        table.add_row("verification", (
            f"{mark}: tokens {'identical' if v['tokens_identical'] else 'DIFFER'}; "
            f"logits max |diff| {_fmt(v['logits_max_abs_diff'])}; "
            f"KV after transfer max |diff| {_fmt(v['kv_max_abs_diff'])} "
            f"(rtol {v['rtol']}, atol {v['atol']})"))
        if v["first_divergence"] and not s.get("errors"):
            table.add_row("diverged at", f"[red]{v['first_divergence']}[/]")
    for e in s.get("errors", []):
        table.add_row("error", f"[red]{e['role']} rank {e['rank']}: {e['error']}[/]")
        if e.get("log"):
            console.print(Panel(e["log"], title=f"{e['role']} rank {e['rank']} log (tail)"))
    if s.get("wall_seconds") is not None:
        table.add_row("wall time", f"{s['wall_seconds']:.1f} s")
    table.add_row("exit code", str(s["exit_code"]))
    if hs["decision"] == "accept":
        console.print(Panel(hs["plans"][0], title="plan of decode rank 0"))
    console.print(table)


def print_reject(console: Console, cfg: DemoConfig, reject: Any) -> None:
    """Every reason, one per line (path, message, both values, fix), then the refusal."""
    from rich.markup import escape

    console.print(f"prefill: {_engine_text(cfg, 'prefill')}")
    console.print(f"decode:  {_engine_text(cfg, 'decode')}")
    n = len(reject.reasons)
    console.print(f"[bold red]fkv refuses this pairing[/]: {n} reason{'s' if n != 1 else ''}")
    for r in reject.reasons:
        console.print(f"  - [bold]{escape(r.path)}[/] ({r.code}): {escape(r.message)} "
                      f"(local {escape(repr(r.local))}, remote {escape(repr(r.remote))})\n"
                      f"    fix: {escape(r.fix)}", soft_wrap=True)
    console.print("Reject: no process was started, no byte moved (exit code 3)")
