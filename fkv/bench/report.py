"""``fkv bench report``: render the measured tables of README.md and bench/NOTES.md from the
committed result files in ``bench/results/`` (the newest measurement of each case).

A generated table sits between ``<!-- fkv-report:NAME -->`` and ``<!-- /fkv-report -->``; the
command rewrites what is between them, ``--check`` only compares (exit 1 when a file differs), and
``--plots DIR`` redraws ``DIR/<bench>.png`` from each benchmark's newest run. A case with no
committed result renders as a row saying so; every figure links the file it came from.

    fkv bench report                 # rewrite README.md and bench/NOTES.md
    fkv bench report --check         # CI: exit 1 if either differs from the results
    fkv bench report --plots docs/plots
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from fkv.bench import results
from fkv.bench.results import Case, ResultFile
from fkv.errors import FkvError

__all__ = ["NO_RESULT", "Row", "main", "render", "sections", "update"]

NO_RESULT = "no committed result yet"
BEGIN = re.compile(r"<!-- fkv-report:([a-z-]+) -->\n")
END = "<!-- /fkv-report -->"
KERNEL_HEAD = ("| op | case | fkv | same-run baseline | of the same-run ceiling | target | run |\n"
               "|---|---|---|---|---|---|---|")
PLOTTED = ("write", "convert", "attention", "plan", "transfer")
# The kernel targets are an H200's: in the kernel tables a case measured on it is shown from its
# newest run there, even when a run on another GPU is newer; runs on other GPUs render in the
# ``other-gpus`` section (and fill the kernel tables only for cases never run on the H200).
TARGET_GPU = "NVIDIA H200"
GPU_BENCHES = ("write", "convert", "attention")

# (fkv, baseline, ceiling, verdict): verdict True/False = target met/missed, None = not judged,
# a str = a verdict of its own (e.g. two halves of a target).
Cells = Callable[[list[Case], ResultFile], tuple[str, str, str, bool | None | str]]


@attrs.frozen
class Row:
    """One table row: ``op`` and ``label`` name it, ``cases`` are its case ids in ``bench``,
    ``cells`` turns those cases (and the newest of their files) into (fkv, baseline, ceiling,
    target met) and ``target`` says what is aimed at ("" = none)."""

    op: str
    label: str
    bench: str
    cases: tuple[str, ...]
    cells: Cells
    target: str = ""


def _slash(values: Sequence[float | None], fmt: str) -> str:
    shown = ["-" if v is None else format(v, fmt) for v in values]
    return " / ".join(shown)


def _range(values: Sequence[float], fmt: str) -> str:
    if not values:  # the cases are there, none with this figure
        return "-"
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}} - {hi:{fmt}}"


def _m(cases: list[Case], name: str) -> list[float | None]:
    return [c.metrics.get(name) for c in cases]


def _all(values: Sequence[float | None], ok: Callable[[float], bool]) -> bool | None:
    return None if any(v is None for v in values) else all(ok(v) for v in values)


def _measured(values: Sequence[float], ok: Callable[[float], bool]) -> bool | None:
    """Every measured value ``ok``; None (not judged) when none was measured."""
    return all(ok(v) for v in values) if values else None


# -- the rows ---------------------------------------------------------------------------------------

def _write_decode(metric: str, base_metric: str, limit: float, digits: str = ".1f",
                  engine_metric: str = "") -> Cells:
    """``metric`` per layout against ``limit``; the baseline cell shows the engine-style
    kernel's ``engine_metric`` (same graph state) where the run has it, then torch's."""
    def cells(cases: list[Case], f: ResultFile) -> tuple[str, str, str, bool | None]:
        us = _m(cases, metric)
        shown = []
        engine = _m(cases, engine_metric) if engine_metric else []
        if any(e is not None for e in engine):
            shown.append(f"engine-style {_slash(engine, '.2f')} us")
        base = _m(cases, base_metric) if base_metric else []
        if any(b is not None for b in base):
            shown.append(f"torch {_slash(base, '.1f')} us")
        return (f"{_slash(us, digits)} us per call", "; ".join(shown), "",
                _all(us, lambda v: v <= limit))
    return cells


def _after_plain(cases: list[Case], f: ResultFile) -> tuple[str, str, str, bool | None]:
    off, on = _m(cases, "after_plain_us"), _m(cases, "after_plain_pdl_us")
    plain = _m(cases, "plain_kernel_us")
    return (f"{_slash(off, '.2f')} us / with PDL {_slash(on, '.2f')} us", "",
            f"the plain kernel alone {_slash(plain, '.2f')} us", None)


def _convert_pairs(cases: list[Case], f: ResultFile) -> tuple[str, str, str, bool | None]:
    gbps = [v for v in _m(cases, "gbps") if v is not None]
    base = [v for v in _m(cases, "baseline_gbps") if v is not None]
    pct = [v for v in _m(cases, "pct_of_copy") if v is not None]
    return (f"{_range(gbps, '.0f')} GB/s", f"torch permute+copy {_range(base, '.0f')} GB/s",
            f"{_range(pct, '.0f')}% of copy ({f.ceilings.get('copy_gbps', 0):.0f} GB/s)",
            _measured(gbps, lambda v: v >= 3400))


def _of_copy(base_name: str, target: float | None) -> Cells:
    """GB/s per layout, the baseline ``base_name`` and its speedup, % of the same-run copy."""
    def cells(cases: list[Case], f: ResultFile) -> tuple[str, str, str, bool | None]:
        gbps = _m(cases, "gbps")
        base = (f"{base_name} {_slash(_m(cases, 'baseline_gbps'), '.0f')} GB/s "
                f"({_slash(_m(cases, 'speedup_x'), '.1f')}x)")
        ceiling = (f"{_slash(_m(cases, 'pct_of_copy'), '.0f')}% of copy "
                   f"({f.ceilings.get('copy_gbps', 0):.0f} GB/s)")
        met = None if target is None else _all(gbps, lambda v: v >= target)
        return f"{_slash(gbps, '.0f')} GB/s", base, ceiling, met
    return cells


def _decode(cases: list[Case], f: ResultFile) -> tuple[str, str, str, bool | None]:
    ratio = _m(cases, "gbps_vs_sdpa_x")
    base = (f"dense SDPA {_slash(_m(cases, 'sdpa_gbps'), '.0f')} GB/s "
            f"({_slash(ratio, '.3f')}x)")
    ceiling = (f"{_slash(_m(cases, 'pct_of_read_ceiling'), '.0f')}% of read "
               f"({f.ceilings.get('read_gbps', 0):.0f} GB/s)")
    return (f"{_slash(_m(cases, 'gbps'), '.0f')} GB/s", base, ceiling,
            _all(ratio, lambda v: v >= 0.92))


def _prefill(cases: list[Case], f: ResultFile) -> tuple[str, str, str, bool | None]:
    ratio = _m(cases, "time_vs_sdpa_x")
    return (f"{_slash(_m(cases, 'ms'), '.3f')} ms",
            f"dense causal SDPA {_slash(_m(cases, 'sdpa_ms'), '.3f')} ms",
            f"{_slash(ratio, '.2f')}x SDPA's time", _all(ratio, lambda v: v <= 1.2))


def _handshake(cases: list[Case], f: ResultFile) -> tuple[str, str, str, str]:
    warm = [v for v in _m(cases, "warm_us") if v is not None]
    cold = [v for v in _m(cases, "cold_us") if v is not None]
    shown = {True: "met", False: "**missed**", None: "not measured"}
    verdict = ", ".join(f"{what} {shown[ok]}" for what, ok in (
        ("warm", _measured(warm, lambda v: v <= 50)),
        ("first contact", _measured(cold, lambda v: v <= 50))))
    return f"{_range(warm, '.0f')} us / {_range(cold, '.0f')} us", "", "", verdict


def _segments(cases: list[Case], f: ResultFile) -> tuple[str, str, str, bool | None]:
    ms = [v for v in _m(cases, "ms") if v is not None]
    speed = [v for v in _m(cases, "speedup_x") if v is not None]
    return (f"{_range(ms, '.1f')} ms", f"per-row Python loop {_range(speed, '.0f')}x slower", "",
            _measured(ms, lambda v: v <= 20))


def _ids(fmt: str, *values: object) -> tuple[str, ...]:
    return tuple(fmt.format(v) for v in values)


_PAIRS = [(a, b) for a in ("triton NHD", "triton HND", "triton NHD xl", "triton HND xl")
          for b in ("triton NHD", "triton HND", "triton NHD xl", "triton HND xl") if a != b]
_PAIRS += [("flash_attn NHD", "triton HND"), ("triton HND", "flash_attn NHD")]
_PLAN_CONFIGS = ("A: P1->D2 HND", "B: P4->D2 HND", "same TP and layout", "NHD P1->D2 (staging)",
                 "layout HND->NHD (staging)", "A, 32 layers, cross-layer both", "MLA P4->D2")

KERNEL_ROWS: dict[str, tuple[Row, ...]] = {
    "write": (
        Row("write_kv", "prefill 65536 tokens, NHD / HND", "write",
            _ids("prefill 65536 {} bfloat16", "NHD", "HND"), _of_copy("torch index_put_", 3600),
            ">= 3600 GB/s"),
        Row("write_kv", "prefill 8192 tokens, NHD / HND", "write",
            _ids("prefill 8192 {} bfloat16", "NHD", "HND"), _of_copy("torch index_put_", 2500),
            ">= 2500 GB/s"),
        Row("write_kv", "decode 256 tokens, per call in a CUDA graph, NHD / HND", "write",
            _ids("decode 256 {} bfloat16", "NHD", "HND"),
            _write_decode("graph_per_call_us", "baseline_graph_per_call_us", 2.2, ".2f",
                          "engine_graph_per_call_us"), "<= 2.2 us"),
        Row("write_kv", "decode 256 tokens, per call in a CUDA graph captured inside "
            "`fkv.ops.graph_primer()`, NHD / HND", "write",
            _ids("decode 256 {} bfloat16", "NHD", "HND"),
            _write_decode("graph_per_call_primed_us", "", 2.2, ".2f",
                          "engine_graph_per_call_primed_us"), "<= 2.2 us"),
        Row("write_kv", "decode 256 tokens, per call in a CUDA graph, `pdl=True`, NHD / HND",
            "write", _ids("decode 256 {} bfloat16", "NHD", "HND"),
            _write_decode("graph_per_call_pdl_us", "baseline_graph_per_call_us", 2.2, ".2f"),
            "<= 2.2 us"),
        Row("write_kv", "fp8 e4m3 cache, decode 256 tokens, per call in a CUDA graph, NHD / HND",
            "write", _ids("decode 256 {} float8_e4m3fn", "NHD", "HND"),
            _write_decode("graph_per_call_us", "baseline_graph_per_call_us", 2.5, ".2f",
                          "engine_graph_per_call_us"), "<= 2.5 us"),
        Row("write_kv", "fp8 e4m3 cache, the same captured inside `fkv.ops.graph_primer()`, "
            "NHD / HND", "write", _ids("decode 256 {} float8_e4m3fn", "NHD", "HND"),
            _write_decode("graph_per_call_primed_us", "", 2.5, ".2f",
                          "engine_graph_per_call_primed_us"), "<= 2.5 us"),
        Row("write_kv", "fp8 e4m3 cache, the same with `pdl=True`, NHD / HND",
            "write", _ids("decode 256 {} float8_e4m3fn", "NHD", "HND"),
            _write_decode("graph_per_call_pdl_us", "baseline_graph_per_call_us", 2.5, ".2f"),
            "<= 2.5 us"),
        Row("write_kv", "decode 256 tokens (bf16) after a plain 1 MiB kernel in the graph, its "
            "share of the pair, NHD / HND", "write", _ids("decode 256 {} bfloat16", "NHD", "HND"),
            _after_plain),
        Row("write_kv", "decode 256 tokens, eager (host included), NHD / HND", "write",
            _ids("decode 256 {} bfloat16", "NHD", "HND"),
            _write_decode("eager_us", "baseline_eager_us", 8.0), "<= 8 us"),
        Row("write_kv", "fp8 e4m3 cache, prefill 65536 tokens, NHD / HND", "write",
            _ids("prefill 65536 {} float8_e4m3fn", "NHD", "HND"), _of_copy("torch index_put_", None)),
    ),
    "convert": (
        Row("convert", f"whole cache (16384 blocks), {len(_PAIRS)} layout pairs "
            "(NHD/HND x per-layer/cross-layer, flash_attn <-> triton)", "convert",
            tuple(f"convert {a} -> {b}" for a, b in _PAIRS), _convert_pairs, ">= 3400 GB/s"),
        Row("gather", "2048 random blocks, heads 0-3 of 8, from NHD / HND", "convert",
            _ids("gather triton {}", "NHD", "HND"), _of_copy("torch index+slice", 3000),
            ">= 3000 GB/s"),
        Row("scatter", "the same, into NHD / HND", "convert", _ids("scatter triton {}", "NHD", "HND"),
            _of_copy("torch index_put", None)),
    ),
    "attention": tuple(
        Row("paged_attention", f"decode B={b} ctx {t}, NHD / HND", "attention",
            _ids(f"decode B={b} x {t} {{}}", "NHD", "HND"), _decode, ">= 0.92x dense SDPA")
        for b, t in ((64, 8192), (256, 2048), (8, 32768), (16, 4096))) + (
        Row("paged_attention", "prefill B=4 x 4096 causal, NHD / HND", "attention",
            _ids("prefill B=4 x 4096 {}", "NHD", "HND"), _prefill, "<= 1.2x SDPA's time"),),
    "plan": (
        Row("handshake", "one call (CPU): warm (spec pair seen before) / cold (first contact), "
            f"{len(_PLAN_CONFIGS)} configurations", "plan",
            tuple(f"handshake {c}" for c in _PLAN_CONFIGS), _handshake, "<= 50 us"),
        Row("plan.segments", "100k blocks (CPU, numpy), random and contiguous ids", "plan",
            tuple(f"segments {c}, {ids} ids, 100000 blocks" for c in _PLAN_CONFIGS
                  for ids in ("random", "contiguous")), _segments, "<= 20 ms"),
    ),
}


# -- rendering ----------------------------------------------------------------------------------------

def _usable(files: list[ResultFile]) -> list[ResultFile]:
    """Result files whose timings mean something (``--cpu-smoke`` runs are left out)."""
    return [f for f in files if not str(f.config.get("mode", "")).startswith("cpu-smoke")]


def _machine(f: ResultFile) -> str:
    if f.env.get("gpu"):
        return str(f.env["gpu"])
    return f"CPU ({f.env.get('cpu_count') or '?'} cores)"


def _link(f: ResultFile, prefix: str, names: Mapping[int, str]) -> str:
    """``[machine, date](prefix + file name)``; ``names``: id(file) -> its name on disk (default:
    the name fkv gives it)."""
    name = names.get(id(f)) or f"{f.bench}-{f.created.replace('-', '').replace(':', '')}.json"
    return f"[{_machine(f)}, {f.created[:10]}]({prefix}{name})"


def _kernel_row(row: Row, latest: dict, prefix: str, names: Mapping[int, str]) -> str:
    found = [latest[(row.bench, c)] for c in row.cases if (row.bench, c) in latest]
    if not found:
        return f"| {row.op} | {row.label} | {NO_RESULT} | | | {row.target or 'none'} | |"
    cases = [c for c, _ in found]
    files = {id(f): f for _, f in found}
    newest = max(files.values(), key=lambda f: f.created)
    fkv, base, ceiling, met = row.cells(cases, newest)
    label = row.label
    if len(found) < len(row.cases):
        label += f" ({len(found)} of {len(row.cases)} cases measured)"
    target = row.target or "none"
    if isinstance(met, str):
        target += f": {met}"
    elif row.target:
        target += {True: ", met", False: ", **missed**", None: ""}[met]
    run = " ".join(_link(f, prefix, names) for f in
                   sorted(files.values(), key=lambda f: f.created))
    return f"| {row.op} | {label} | {fkv} | {base} | {ceiling} | {target} | {run} |"


def _on_target(f: ResultFile) -> bool:
    """Not a GPU kernel run, or one on ``TARGET_GPU``."""
    return f.bench not in GPU_BENCHES or f.env.get("gpu") == TARGET_GPU


def _other_gpus(files: list[ResultFile], prefix: str, names: Mapping[int, str]) -> str:
    """The kernel rows measured on GPUs other than ``TARGET_GPU``, one table per GPU (newest
    run of each case on that GPU; rows with no case measured there are left out)."""
    others = sorted({str(f.env.get("gpu")) for f in files if not _on_target(f)})
    if not others:
        return f"No kernel run on a GPU other than the {TARGET_GPU} is committed."
    parts = []
    for gpu in others:
        latest = results.latest_cases([f for f in files if not _on_target(f)
                                       and str(f.env.get("gpu")) == gpu])
        rows = [_kernel_row(r, latest, prefix, names) for rows in KERNEL_ROWS.values()
                for r in rows if r.bench in GPU_BENCHES
                and any((r.bench, c) in latest for c in r.cases)]
        parts.append(f"**{gpu}** (the targets are the {TARGET_GPU}'s, shown for reference)\n\n"
                     + "\n".join([KERNEL_HEAD] + rows))
    return "\n\n".join(parts)


def _transfer(files: list[ResultFile], prefix: str, names: Mapping[int, str]) -> str:
    runs = [f for f in files if f.bench == "transfer"]
    head = ("| case | path | request | GB/s | ratios (same run) | run |\n"
            "|---|---|---|---|---|---|")
    if not runs:
        return f"{head}\n| transfer | | | {NO_RESULT} | | |"
    newest: dict[str, tuple[Case, ResultFile]] = {}
    for run in runs:  # oldest first: a later run of the same case replaces it, unless it errored
        for case in run.cases:
            if not case.error or case.case not in newest:
                newest[case.case] = (case, run)
    lines = [head]
    for c, f in newest.values():
        size = c.params.get("request_bytes")
        req = f"{size / 2**20:.0f} MiB" if isinstance(size, int | float) else ""
        ratios = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f}x" for k, v in c.metrics.items()
                           if k.endswith("_x") and v is not None)
        gbps = c.metrics.get("gbps")
        shown = f"error: {c.error}" if c.error else ("-" if gbps is None else f"{gbps:.2f}")
        lines.append(f"| {c.case} | {c.params.get('path', '')} | {req} | {shown} | {ratios} | "
                     f"{_link(f, prefix, names)} |")
    return "\n".join(lines)


def _tests(files: list[ResultFile], prefix: str, names: Mapping[int, str]) -> str:
    head = ("| test run | machine | passed | failed | skipped | deselected | duration | commit | run |\n"
            "|---|---|---|---|---|---|---|---|---|")
    latest: dict[str, tuple[Case, ResultFile]] = {}
    for f in files:
        if f.bench == "tests":
            for c in f.cases:
                latest[c.case] = (c, f)
    if not latest:
        return f"{head}\n| pytest -m gpu | | {NO_RESULT} | | | | | | |"
    lines = [head]
    for name, (c, f) in sorted(latest.items()):
        m = {k: int(v or 0) for k, v in c.metrics.items() if k.endswith("_count")}
        lines.append(f"| {name} | {_machine(f)} | {m.get('passed_count', 0)} | "
                     f"{m.get('failed_count', 0) + m.get('errors_count', 0)} | "
                     f"{m.get('skipped_count', 0)} | {m.get('deselected_count', 0)} | "
                     f"{c.metrics.get('duration_s') or 0:.0f} s | "
                     f"`{str(f.env.get('git_commit') or '?')[:9]}` | {_link(f, prefix, names)} |")
    return "\n".join(lines)


def sections(files: list[ResultFile], prefix: str = "bench/results/",
             plots: str | None = "docs/plots/", names: Mapping[int, str] | None = None
             ) -> dict[str, str]:
    """Every generated section by name; ``prefix`` is the results folder as seen from the
    document the tables go into, ``plots`` the plots folder (``None``: no picture links),
    ``names`` maps ``id(file)`` to its file name when it is not the default one."""
    names = names or {}
    files = sorted(_usable(files), key=lambda f: f.created)
    latest = results.latest_cases(files) | results.latest_cases(
        [f for f in files if f.bench in GPU_BENCHES and f.env.get("gpu") == TARGET_GPU])
    out = {}
    for name, rows in KERNEL_ROWS.items():
        out[name] = "\n".join([KERNEL_HEAD] + [_kernel_row(r, latest, prefix, names) for r in rows])
    out["standing"] = "\n".join([KERNEL_HEAD] + [_kernel_row(r, latest, prefix, names)
                                                 for rows in KERNEL_ROWS.values() for r in rows])
    out["other-gpus"] = _other_gpus(files, prefix, names)
    out["transfer"] = _transfer(files, prefix, names)
    out["tests"] = _tests(files, prefix, names)
    if plots is not None:
        for bench in PLOTTED:
            if any(f.bench == bench for f in files):
                out[bench] += f"\n\n![{bench}: newest committed run]({plots}{bench}.png)"
    return out


def update(text: str, rendered: dict[str, str], source: str = "document") -> str:
    """``text`` with every ``fkv-report`` section replaced by its rendering."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        name = m.group(1)
        if name not in rendered:
            raise FkvError(f"{source}: '<!-- fkv-report:{name} -->' must name one of "
                           f"{sorted(rendered)} (got {name!r})")
        end = text.find(END, m.end())
        if end < 0:
            raise FkvError(f"{source}: section {name!r} must end with {END!r} (none found)")
        out += [text[pos:m.end()], rendered[name], "\n"]
        pos = end
    return "".join(out) + text[pos:]


def render(path: Path, files: list[ResultFile], results_dir: Path,
           names: Mapping[int, str] | None = None) -> str:
    """The document at ``path`` with its sections rendered from ``files`` (which lie in
    ``results_dir``; ``names`` as for :func:`sections`)."""
    root = path.parent.resolve()
    prefix = _relative(results_dir.resolve(), root)
    plots = _relative((results_dir / ".." / ".." / "docs" / "plots").resolve(), root)
    return update(path.read_text(), sections(files, prefix, plots, names), str(path))


def _relative(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target, start).replace("\\", "/") + "/"


def _usage(message: str) -> int:
    print(f"fkv bench report: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    from fkv.cli import existing_file, existing_folder, output_folder

    parser = argparse.ArgumentParser(prog="fkv bench report",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    root = results._repo_root() or Path.cwd()
    parser.add_argument("--results", metavar="DIR", type=existing_folder,
                        default=None, help="an existing folder of result files (default: the "
                                           "checkout's bench/results)")
    parser.add_argument("--docs", metavar="PATH", type=existing_file, nargs="*",
                        default=[root / "README.md", root / "bench" / "NOTES.md"],
                        help="documents with fkv-report sections (default: README.md "
                             "bench/NOTES.md)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a document differs from its rendering")
    parser.add_argument("--plots", metavar="DIR", type=output_folder,
                        help="also draw DIR/<bench>.png from each benchmark's newest run "
                             "(DIR created if missing)")
    args = parser.parse_args(argv)
    folder = args.results or root / "bench" / "results"
    if not folder.is_dir():  # the default one (a given --results was checked when parsed)
        return _usage(f"--results: the default folder {str(folder)!r} does not exist; name "
                      f"the folder of result files with --results DIR")
    if not args.docs and args.plots is None:
        return _usage("--docs names no document and --plots no folder: nothing to do")
    missing = [str(doc) for doc in args.docs if not doc.is_file()]
    if missing:  # the default ones
        return _usage(f"--docs: {', '.join(map(repr, missing))} not found; name the documents "
                      f"with --docs PATH ...")
    try:
        loaded = results.load_paths(folder)
    except FkvError as e:
        return _usage(f"--results {str(folder)!r}: {e}")
    if not _usable([f for _, f in loaded]):
        what = ("only --cpu-smoke runs, whose timings mean nothing" if loaded
                else "no result files (*.json)")
        return _usage(f"--results {str(folder)!r} holds {what}; the tables would all say "
                      f"{NO_RESULT!r}")
    names = {id(f): p.name for p, f in loaded}
    files = [f for _, f in loaded]
    stale, rendered = [], {}
    try:
        for doc in args.docs:
            rendered[doc] = render(doc, files, folder, names)
    except FkvError as e:
        return _usage(f"--docs: {e}")
    for doc, new in rendered.items():
        if new != doc.read_text():
            stale.append(str(doc))
            if not args.check:
                doc.write_text(new)
    if args.plots is not None:
        from fkv.bench import plots

        plots.require(cli=True)
        for bench in PLOTTED:
            runs = [f for f in _usable(files) if f.bench == bench]
            if runs:
                print(f"plot: {plots.plot_file(runs[-1], Path(args.plots) / f'{bench}.png')}")
    if args.check and stale:
        print(f"out of date with {folder}: {', '.join(stale)}; run: fkv bench report",
              file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "up to date")
    return 0
