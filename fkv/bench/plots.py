"""Pictures of result files (:mod:`fkv.bench.results`): one PNG per benchmark run.

Needs matplotlib (``pip install 'fkv[plot]'``). Figures are drawn on matplotlib's Agg canvas
directly, so plotting never changes the pyplot backend of the caller (a notebook keeps its own).
Each function takes a :class:`~fkv.bench.results.ResultFile`, a path to one, or its decoded dict,
and writes ``out`` (PNG):

- :func:`plot_write`: GB/s against tokens per layout and cache dtype, the torch baseline dashed,
  the same-run copy ceiling;
- :func:`plot_convert`: GB/s per convert/gather/scatter case beside the torch baseline, the copy
  ceiling;
- :func:`plot_attention`: decode GB/s per shape for NHD and HND beside dense SDPA, the read
  ceiling; prefill time beside SDPA's;
- :func:`plot_plan`: handshake µs (warm, cold) and segments ms against their targets;
- :func:`plot_transfer`: GB/s against request size per path, with the link ceilings measured in
  the same run (see its docstring for the fields it reads).
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from fkv.bench import results
from fkv.errors import FkvError

__all__ = ["LINK_CEILINGS", "plot_attention", "plot_convert", "plot_file", "plot_plan",
           "plot_transfer", "plot_write", "require"]

INSTALL = "pip install 'fkv[plot]' (or: pip install matplotlib)"

# Transfer ceilings, by metric name: drawn as lines against request size (per-case metrics) or
# across the plot (file-level ``ceilings``).
LINK_CEILINGS = {"peer_copy_gbps": "peer copy (same run)", "nccl_gbps": "NCCL send/recv (same run)",
                 "link_gbps": "one contiguous descriptor (link)"}


def require(cli: bool = False) -> None:
    """Raise (``cli``: exit with a message) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        msg = f"--plot needs matplotlib, which is not installed: {INSTALL}"
        if cli:
            raise SystemExit(msg) from None
        raise ModuleNotFoundError(msg, name="matplotlib") from None


def _figure(ncols: int = 1, width: float = 7.0) -> tuple[Any, list[Any]]:
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _as_file(doc: Any) -> results.ResultFile:
    if isinstance(doc, results.ResultFile):
        return doc
    if isinstance(doc, str | os.PathLike):
        return results.load(doc)
    return results.check(msgspec.to_builtins(doc), source="plotted result")


def _save(fig: Any, out: str | os.PathLike, f: results.ResultFile) -> Path:
    where = f.env.get("gpu") or f.env.get("cpu") or "?"
    commit = str(f.env.get("git_commit") or "?")[:9]
    fig.suptitle(f"{where}, {f.created[:10]}, commit {commit}", fontsize=9)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _ok(f: results.ResultFile, metric: str) -> list[results.Case]:
    return [c for c in f.cases if not c.error and c.metrics.get(metric) is not None]


def _ceiling_line(ax: Any, value: float | None, label: str, vertical: bool = False) -> None:
    if value:
        line = ax.axvline if vertical else ax.axhline
        line(value, color="black", linestyle=":", linewidth=1.2, label=f"{label} {value:.0f} GB/s")


def plot_write(doc: Any, out: str | os.PathLike) -> Path:
    """write_kv GB/s against tokens per call, one line per (layout, cache dtype)."""
    f = _as_file(doc)
    fig, (ax,) = _figure()
    series: dict[tuple, list[results.Case]] = defaultdict(list)
    for c in _ok(f, "gbps"):
        series[(c.params["layout"], c.params["dtype"])].append(c)
    for (layout, dtype), cases in sorted(series.items()):
        cases.sort(key=lambda c: c.params["tokens"])
        x = [c.params["tokens"] for c in cases]
        (line,) = ax.plot(x, [c.metrics["gbps"] for c in cases], marker="o",
                          label=f"fkv {layout} {dtype}")
        base = [c.metrics.get("baseline_gbps") for c in cases]
        if all(b is not None for b in base):
            ax.plot(x, base, marker="x", linestyle="--", color=line.get_color(), alpha=0.6,
                    label=f"torch index_put_ {layout} {dtype}")
    _ceiling_line(ax, f.ceilings.get("copy_gbps"), "copy ceiling")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens per call", ylabel="GB/s (bytes read + written)",
           title="write_kv")
    ax.legend(fontsize=7)
    return _save(fig, out, f)


def plot_convert(doc: Any, out: str | os.PathLike) -> Path:
    """convert/gather/scatter GB/s per case beside the torch baseline."""
    f = _as_file(doc)
    cases = _ok(f, "gbps")
    fig, (ax,) = _figure(width=9.0)
    y = list(range(len(cases)))
    ax.barh([i + 0.2 for i in y], [c.metrics["gbps"] for c in cases], height=0.4, label="fkv")
    ax.barh([i - 0.2 for i in y], [c.metrics.get("baseline_gbps") or 0 for c in cases],
            height=0.4, label="torch baseline", alpha=0.6)
    _ceiling_line(ax, f.ceilings.get("copy_gbps"), "copy ceiling", vertical=True)
    ax.set_yticks(y, [c.case for c in cases], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="GB/s (bytes read + written)", title="convert / gather / scatter")
    ax.legend(fontsize=7)
    return _save(fig, out, f)


def plot_attention(doc: Any, out: str | os.PathLike) -> Path:
    """Decode GB/s of K+V per shape (NHD, HND, dense SDPA) and prefill ms beside SDPA's."""
    f = _as_file(doc)
    fig, (dec, pre) = _figure(ncols=2, width=6.0)
    for ax, kind, metric, sdpa in ((dec, "decode", "gbps", "sdpa_gbps"),
                                   (pre, "prefill", "ms", "sdpa_ms")):
        shapes: dict[tuple, dict[str, results.Case]] = defaultdict(dict)
        for c in _ok(f, metric):
            if c.params["kind"] == kind:
                shapes[(c.params["batch"], c.params["tokens"])][c.params["layout"]] = c
        keys = sorted(shapes)
        for j, bar in enumerate(("NHD", "HND", "dense SDPA")):
            vals = []
            for k in keys:
                if bar == "dense SDPA":
                    vals.append(statistics.median(c.metrics[sdpa] for c in shapes[k].values()))
                else:
                    vals.append(shapes[k][bar].metrics[metric] if bar in shapes[k] else 0.0)
            ax.bar([i + (j - 1) * 0.27 for i in range(len(keys))], vals, width=0.27,
                   label=bar if bar != "dense SDPA" else "dense SDPA (same run)")
        ax.set_xticks(range(len(keys)), [f"B={b} x {t}" for b, t in keys])
        if kind == "decode":
            _ceiling_line(ax, f.ceilings.get("read_gbps"), "read ceiling")
            ax.set(ylabel="GB/s of K+V read", title="paged_attention decode")
        else:
            ax.set(ylabel="ms per call (lower is better)",
                   title="paged_attention prefill (causal)")
        ax.legend(fontsize=7)
    return _save(fig, out, f)


def plot_plan(doc: Any, out: str | os.PathLike) -> Path:
    """Handshake µs per call (warm, cold) and segments ms per call, against their targets."""
    f = _as_file(doc)
    fig, (hs, seg) = _figure(ncols=2, width=6.5)
    hcases = [c for c in _ok(f, "warm_us") if c.case.startswith("handshake ")]
    y = list(range(len(hcases)))
    hs.barh([i - 0.2 for i in y], [c.metrics["warm_us"] for c in hcases], height=0.4,
            label="warm (spec pair seen before)")
    hs.barh([i + 0.2 for i in y], [c.metrics.get("cold_us") or 0 for c in hcases], height=0.4,
            label="cold (first contact)")
    hs.set_yticks(y, [c.params["config"] for c in hcases], fontsize=7)
    scases = [c for c in _ok(f, "ms") if c.case.startswith("segments ")]
    z = list(range(len(scases)))
    seg.barh(z, [c.metrics["ms"] for c in scases], height=0.6, label="segments")
    seg.set_yticks(z, [f"{c.params['config']}, {c.params['ids']}" for c in scases], fontsize=6)
    for ax, cases, metric, unit in ((hs, hcases, "target_us", "µs"), (seg, scases, "target_ms",
                                                                        "ms")):
        targets = {c.metrics.get(metric) for c in cases} - {None}
        for t in targets:
            ax.axvline(t, color="black", linestyle=":", label=f"target {t:g} {unit}")
        ax.invert_yaxis()
        ax.legend(fontsize=7)
    blocks = {c.params["blocks"] for c in scases}
    hs.set(xlabel="µs per call", title="handshake (CPU)")
    sizes = ", ".join(map(str, sorted(blocks)))
    seg.set(xlabel="ms per call", title=f"plan.segments, {sizes} blocks")
    return _save(fig, out, f)


def plot_transfer(doc: Any, out: str | os.PathLike) -> Path:
    """Transfer GB/s against request size, one line per path, with the link ceilings.

    Reads, per case: ``params["path"]`` (the series; ``params["series"]`` overrides the label,
    e.g. ``"packed, 2 GPUs"``), ``params["request_bytes"]`` (x) and ``metrics["gbps"]`` (y).
    Ceilings: per-case metrics named in :data:`LINK_CEILINGS` (``peer_copy_gbps``,
    ``nccl_gbps``, ``link_gbps``) are drawn against request size (median over the cases of one
    size); the same names in the file's ``ceilings`` are drawn across the plot.
    """
    f = _as_file(doc)
    fig, (ax,) = _figure(width=8.0)
    series: dict[str, list[results.Case]] = defaultdict(list)
    for c in _ok(f, "gbps"):
        if "request_bytes" not in c.params:
            raise FkvError(f"case {c.case!r}: 'params.request_bytes' must be set to plot a "
                           f"transfer (got params {sorted(c.params)})")
        series[str(c.params.get("series") or c.params.get("path") or c.case)].append(c)
    for label, cases in sorted(series.items()):
        cases.sort(key=lambda c: c.params["request_bytes"])
        ax.plot([c.params["request_bytes"] / 2**20 for c in cases],
                [c.metrics["gbps"] for c in cases], marker="o", label=label)
    for name, label in LINK_CEILINGS.items():
        by_size: dict[float, list[float]] = defaultdict(list)
        for c in f.cases:
            if c.metrics.get(name) is not None:
                by_size[c.params["request_bytes"] / 2**20].append(c.metrics[name])
        if by_size:
            xs = sorted(by_size)
            ax.plot(xs, [statistics.median(by_size[x]) for x in xs], linestyle=":",
                    color="black" if name == "peer_copy_gbps" else "gray", label=label)
        elif f.ceilings.get(name):
            _ceiling_line(ax, f.ceilings[name], label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="request size (MiB, all decode ranks)", ylabel="GB/s landed in decode caches",
           title="prefill -> decode transfer")
    ax.legend(fontsize=7)
    return _save(fig, out, f)


PLOTTERS = {"write": plot_write, "convert": plot_convert, "attention": plot_attention,
            "plan": plot_plan, "transfer": plot_transfer}


def plot_file(doc: Any, out: str | os.PathLike) -> Path:
    """The plot of a result file's benchmark (by its ``bench``)."""
    f = _as_file(doc)
    if f.bench not in PLOTTERS:
        raise FkvError(f"'bench' must be one of {sorted(PLOTTERS)} to plot (got {f.bench!r})")
    return PLOTTERS[f.bench](f, out)
