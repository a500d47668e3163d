"""Raw benchmark results: one versioned JSON file per run, with the environment it ran in.

Every benchmark (and a GPU test run, see ``tests/conftest.py``) writes one file,
``bench/results/<bench>-<UTC timestamp>.json`` by default, shaped as :class:`ResultFile`
(schema ``"fkv.bench/1"``; the field-by-field description is ``docs/benchmarks.md``)::

    {"schema": "fkv.bench/1", "bench": "write", "created": "2026-12-01T10:20:30Z",
     "env": {"gpu": "NVIDIA H200", "torch": "2.11.0", "git_commit": "15b4cd1...", ...},
     "config": {"quick": false, "shape": {...}},            # how the run was invoked
     "ceilings": {"copy_gbps": 4228.0},                      # measured in the same run
     "cases": [{"case": "prefill 65536 NHD bfloat16",         # unique id within the file
                "params": {"kind": "prefill", "tokens": 65536, "layout": "NHD"},
                "metrics": {"gbps": 3647.1, "baseline_gbps": 696.2, "pct_of_copy": 86.3},
                "units": {"gbps": "GB/s", "baseline_gbps": "GB/s", "pct_of_copy": "%"},
                "error": "", "extra": {}}],
     "extra": {"sweep": [...]}}

Metric names end in a unit suffix (``_gbps`` GB/s, ``_ms``, ``_us``, ``_s``, ``_bytes``, ``_x`` a
ratio, ``pct_``/``_pct`` percent, ``_count``, ``_tflops``, ``_err`` an absolute error) from which :func:`unit_of` fills
``units``; ``metrics`` hold numbers only (``None`` = not measured), everything else goes to
``params`` or ``extra``.

>>> run = Run("plan", config={"quick": True}, env={})
>>> case = run.add("handshake A", params={"strategy": "direct"}, metrics={"warm_us": 28.1})
>>> case.units
{'warm_us': 'us'}
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import re
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from fkv.connector.transport._ipc import mps_running
from fkv.errors import FkvError, field_error

__all__ = ["SCHEMA", "Case", "ResultFile", "Run", "add_output_arguments", "check",
           "default_results_dir", "environment", "json_schema", "latest_cases", "load",
           "load_all", "load_paths", "save", "unit_of", "write"]

SCHEMA = "fkv.bench/1"
_CREATED = "%Y-%m-%dT%H:%M:%SZ"  # ResultFile.created, UTC

Scalar = str | int | float | bool | None
Param = Scalar | list[Scalar] | dict[str, Scalar]

# Metric-name suffix -> unit (longest match first); see the module docstring.
_UNITS = (("_tflops", "TFLOP/s"), ("_gbps", "GB/s"), ("_bytes", "B"), ("_count", "1"),
          ("_ms", "ms"), ("_us", "us"), ("_s", "s"), ("_x", "x"), ("_pct", "%"),
          ("_err", "1"))


class Case(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One measured case: a unique ``case`` id, what it is (``params``), what it measured."""

    case: str
    params: dict[str, Param] = {}
    metrics: dict[str, float | None] = {}
    units: dict[str, str] = {}
    error: str = ""
    extra: dict[str, Any] = {}


class ResultFile(msgspec.Struct, forbid_unknown_fields=True):
    """One run of one benchmark (``bench``) at ``created`` (UTC, ISO 8601, ``Z``)."""

    schema: str
    bench: str
    created: str
    env: dict[str, Param]
    cases: list[Case]
    config: dict[str, Any] = {}
    ceilings: dict[str, float] = {}
    extra: dict[str, Any] = {}


def unit_of(metric: str) -> str:
    """The unit a metric name declares by its suffix (``pct_`` prefix: percent).

    >>> unit_of("baseline_gbps"), unit_of("pct_of_copy"), unit_of("speedup_x")
    ('GB/s', '%', 'x')
    """
    if metric.startswith("pct_"):
        return "%"
    for suffix, unit in _UNITS:
        if metric.endswith(suffix) or metric == suffix[1:]:
            return unit
    raise field_error("metric", metric, "a name ending in a unit suffix ("
                      + ", ".join(s for s, _ in _UNITS) + ") or starting with 'pct_'",
                      "rename it, or put a value without a unit in 'params' or 'extra'")


class Run:
    """A run being recorded: ``add`` cases as they finish, then :func:`write` it.

    ``env`` defaults to :func:`environment` (``device`` picks whether CUDA facts are read).
    """

    def __init__(self, bench: str, *, config: Mapping[str, Any] | None = None,
                 env: Mapping[str, Param] | None = None, device: str = "cpu") -> None:
        self.bench = bench
        self.created = _utc_now()
        self.env = dict(environment(device) if env is None else env)
        self.config = dict(config or {})
        self.ceilings: dict[str, float] = {}
        self.cases: list[Case] = []
        self.extra: dict[str, Any] = {}

    def ceiling(self, name: str, value: float) -> None:
        """A ceiling measured in this run, e.g. ``ceiling("copy_gbps", 4228.0)``."""
        unit_of(name)
        self.ceilings[name] = float(value)

    def add(self, case: str, *, params: Mapping[str, Param] | None = None,
            metrics: Mapping[str, float | int | bool | None] | None = None, error: str = "",
            extra: Mapping[str, Any] | None = None) -> Case:
        if any(c.case == case for c in self.cases):
            raise field_error("case", case, "unique within a run", "add each case once")
        m = {k: (None if v is None else float(v)) for k, v in (metrics or {}).items()}
        c = Case(case=case, params=dict(params or {}), metrics=m,
                 units={k: unit_of(k) for k in m}, error=error, extra=dict(extra or {}))
        self.cases.append(c)
        return c

    def to_file(self) -> ResultFile:
        return ResultFile(schema=SCHEMA, bench=self.bench, created=self.created, env=self.env,
                          cases=list(self.cases), config=self.config, ceilings=self.ceilings,
                          extra=self.extra)


def write(run: Run | ResultFile, json_path: str | os.PathLike | None = None,
          results_dir: str | os.PathLike | None = None) -> Path:
    """Validate ``run`` and write it: to ``json_path`` when given, else to
    ``results_dir`` (default :func:`default_results_dir`) as ``<bench>-<created>.json``
    (``-2``, ``-3``... if taken). Returns the path written."""
    doc = run.to_file() if isinstance(run, Run) else run
    data = msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n"
    check(msgspec.json.decode(data), source=f"the {doc.bench!r} run being written")
    if json_path is not None:
        path = Path(json_path)
    else:
        folder = Path(results_dir) if results_dir is not None else default_results_dir()
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{doc.bench}-{doc.created.replace('-', '').replace(':', '')}"
        path, n = folder / f"{stem}.json", 1
        while path.exists():
            n += 1
            path = folder / f"{stem}-{n}.json"
    path.write_bytes(data)
    return path


def add_output_arguments(parser: Any, *, plot: bool = True) -> None:
    """The output options every benchmark takes: ``--json``, ``--results-dir``, ``--no-save``
    and (``plot=True``) ``--plot``; :func:`save` acts on the first three.

    Each is checked when the command line is parsed, before anything runs (a bad one is a usage
    error, exit 2): ``--json`` and ``--plot`` name a file in a folder that exists;
    ``--results-dir`` names a folder, created (with its parents) when missing, as the default
    folder is."""
    from fkv.cli import output_file, output_folder

    parser.add_argument("--json", metavar="PATH", type=output_file,
                        help="write the result file here, in an existing folder (default: "
                             "bench/results/<bench>-<UTC>.json)")
    parser.add_argument("--results-dir", metavar="DIR", type=output_folder,
                        help="folder for the result file, created if missing (default: "
                             "$FKV_RESULTS_DIR or the checkout's bench/results)")
    parser.add_argument("--no-save", action="store_true", help="write no result file")
    if plot:
        parser.add_argument("--plot", metavar="PATH", type=output_file,
                            help="also draw the results as a PNG, in an existing folder (needs "
                                 "matplotlib: pip install 'fkv[plot]')")


def save(run: Run, args: Any, *, by_default: bool = True) -> Path | None:
    """Write ``run`` as the parsed :func:`add_output_arguments` options say: ``--json PATH``,
    else ``--results-dir``, else the default folder when ``by_default`` (pass ``False`` for runs
    whose timings mean nothing, e.g. ``--cpu-smoke``); ``--no-save`` writes nothing."""
    if getattr(args, "no_save", False):
        return None
    json_path, folder = getattr(args, "json", None), getattr(args, "results_dir", None)
    if json_path is None and folder is None and not by_default:
        return None
    path = write(run, json_path, folder)
    print(f"results: {path}", flush=True)
    return path


def check(doc: Any, source: str = "result") -> ResultFile:
    """Validate a decoded JSON document against the schema; FkvError names the file and field."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise FkvError(f"{source}: 'schema' must be {SCHEMA!r} (got {got!r}); "
                       f"fkv reads only its own result files, version 1")
    try:
        res = msgspec.convert(doc, ResultFile)
    except msgspec.ValidationError as e:
        raise FkvError(f"{source}: {e} (schema {SCHEMA}, see docs/benchmarks.md)") from None
    problems = []
    try:  # zero-padded as written: files are ordered by comparing these strings
        padded = _dt.datetime.strptime(res.created, _CREATED).strftime(_CREATED) == res.created
    except ValueError:
        padded = False
    if not padded:
        problems.append(f"'created' must be UTC 'YYYY-MM-DDTHH:MM:SSZ' (got {res.created!r})")
    seen: set[str] = set()
    for i, c in enumerate(res.cases):
        if c.case in seen:
            problems.append(f"'cases[{i}].case' must be unique (got {c.case!r} twice)")
        seen.add(c.case)
        missing = sorted(set(c.metrics) - set(c.units))
        if missing:
            problems.append(f"'cases[{i}].units' must name a unit for every metric (missing "
                            f"{missing} in case {c.case!r})")
    if problems:
        raise FkvError(f"{source}: " + "; ".join(problems))
    return res


def load(path: str | os.PathLike) -> ResultFile:
    """Read and validate one result file."""
    p = Path(path)
    try:
        doc = msgspec.json.decode(p.read_bytes())
    except msgspec.DecodeError as e:
        raise FkvError(f"{p}: not JSON ({e})") from None
    return check(doc, source=str(p))


def load_all(folder: str | os.PathLike | None = None, bench: str | None = None) -> list[ResultFile]:
    """Every result file in ``folder`` (default :func:`default_results_dir`), oldest first."""
    return [f for _, f in load_paths(folder, bench)]


def load_paths(folder: str | os.PathLike | None = None,
               bench: str | None = None) -> list[tuple[Path, ResultFile]]:
    """``(path, file)`` of every result file in ``folder``, oldest first. A ``folder`` given
    must exist (FkvError otherwise); the default one may not (no files yet)."""
    if folder is not None and not Path(folder).is_dir():
        raise field_error("folder", str(folder), "an existing folder of result files",
                          "a file" if Path(folder).exists() else "no such folder")
    folder = Path(folder) if folder is not None else default_results_dir()
    found = [(p, load(p)) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return sorted(((p, f) for p, f in found if bench is None or f.bench == bench),
                  key=lambda pf: (pf[1].created, *_written_order(pf[0].name)))


def _written_order(name: str) -> tuple[str, int]:
    """Files of one second in the order :func:`write` names them: ``X.json``, ``X-2.json``,
    ``X-3.json`` ... ``X-10.json`` (by name, ``X-2`` and ``X-10`` would come before ``X``)."""
    m = re.fullmatch(r"(.*?)(?:-(\d+))?\.json", name)
    return (m.group(1), int(m.group(2) or 1)) if m else (name, 1)


def latest_cases(files: Iterable[ResultFile]) -> dict[tuple[str, str], tuple[Case, ResultFile]]:
    """``(bench, case id) -> (case, its file)`` from the newest file holding that case; cases
    that errored do not replace an earlier good measurement."""
    out: dict[tuple[str, str], tuple[Case, ResultFile]] = {}
    for f in sorted(files, key=lambda f: f.created):
        for c in f.cases:
            if not c.error or (f.bench, c.case) not in out:
                out[(f.bench, c.case)] = (c, f)
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a result file (for tools other than fkv)."""
    return msgspec.json.schema(ResultFile)


def default_results_dir() -> Path:
    """``$FKV_RESULTS_DIR`` if set, else ``bench/results`` of the checkout fkv runs from (when
    it is one), else ``./bench/results``."""
    if os.environ.get("FKV_RESULTS_DIR"):
        return Path(os.environ["FKV_RESULTS_DIR"])
    root = _repo_root()
    return (root if root is not None else Path.cwd()) / "bench" / "results"


# -- environment header ----------------------------------------------------------------------------

def environment(device: str = "cpu") -> dict[str, Param]:
    """Where a run happened: GPU(s), driver, CUDA (and whether MPS runs), library versions, the
    ``UCX_*``, ``NIXL_*``, ``FKV_*`` and ``CUDA_MPS_*`` environment variables set
    (``env_vars``), git commit and dirty flag, date."""
    env: dict[str, Param] = {
        "date": _utc_now(),
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
    }
    env |= _versions()
    env |= _cuda(device)
    env["env_vars"] = {k: v for k, v in sorted(os.environ.items())
                       if k.startswith(("UCX_", "NIXL_", "FKV_", "CUDA_MPS_"))
                       and k not in ("FKV_RESULTS_DIR", "FKV_GIT_COMMIT")}
    env |= _git()
    return env


def _versions() -> dict[str, Param]:
    from importlib import metadata

    out: dict[str, Param] = {}
    for key, dists in (("fkv", ("fkv",)), ("torch", ("torch",)), ("triton", ("triton",)),
                       ("nixl", ("nixl", "nixl-cu12", "nixl-cu13")), ("numpy", ("numpy",)),
                       ("pyzmq", ("pyzmq",)), ("msgspec", ("msgspec",))):
        out[key] = None
        for d in dists:
            try:
                out[key] = metadata.version(d)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def _cuda(device: str) -> dict[str, Param]:
    out: dict[str, Param] = {"device": device, "gpu": None, "gpu_count": 0, "cuda": None,
                             "driver": None}
    try:
        import torch
    except ImportError:
        return out
    out["cuda"] = torch.version.cuda
    if device == "cuda" or str(device).startswith("cuda"):
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
            out["gpu_count"] = torch.cuda.device_count()
            out["driver"] = _nvidia_smi("driver_version")
            out["mps"] = mps_running()  # kernels of processes sharing a GPU overlap
    return out


def _nvidia_smi(field: str) -> str | None:
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = res.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):  # no /proc/cpuinfo here: the platform's name below
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _repo_root() -> Path | None:
    """The git checkout this fkv is imported from (``None`` for an installed wheel)."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / ".git").exists() and (here / "fkv").is_dir() else None


def _git() -> dict[str, Param]:
    """The checkout's commit and dirty flag; ``FKV_GIT_COMMIT`` names the commit instead where
    the checkout cannot (a copy of a committed tree whose ``.git`` is not that commit's, as on a
    machine the tree was copied to): the dirty flag is then unknown (None)."""
    told = os.environ.get("FKV_GIT_COMMIT", "").strip()
    if told:
        if len(told) != 40 or any(c not in "0123456789abcdef" for c in told):
            raise field_error("FKV_GIT_COMMIT", told, "a commit id of 40 lowercase hex digits")
        return {"git_commit": told, "git_dirty": None}
    root = _repo_root()
    if root is None:
        return {"git_commit": None, "git_dirty": None}

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime(_CREATED)


def iter_metrics(files: Iterable[ResultFile]) -> Iterator[tuple[str, str, str, float | None]]:
    """``(bench, case, metric, value)`` over every case of ``files`` (handy in a notebook)."""
    for f in files:
        for c in f.cases:
            for k, v in c.metrics.items():
                yield f.bench, c.case, k, v
