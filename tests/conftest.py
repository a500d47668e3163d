"""Test configuration: Triton runs on CPU under the interpreter when there is no GPU."""

from __future__ import annotations

import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False

if not HAS_CUDA:
    # Must be set before triton is first imported (kernels run in the interpreter on CPU tensors).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without CUDA the ``gpu`` tests are deselected (not skipped): they run on the GPU machine
    with ``pytest -m gpu``. With CUDA the ``interpreter`` twins are deselected instead."""
    drop = "gpu" if not HAS_CUDA else "interpreter"
    keep = [item for item in items if drop not in item.keywords]
    gone = [item for item in items if drop in item.keywords]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> str:
    if HAS_CUDA:
        return "fkv: CUDA present: gpu tests run, interpreter twins deselected"
    return "fkv: no CUDA: kernels run under TRITON_INTERPRET=1; gpu tests deselected"


@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.interpreter),
                        pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Kernel tests take this: CPU under the Triton interpreter (CI), or CUDA under ``gpu``."""
    return request.param


# -- a record of the run: FKV_RESULTS_DIR=DIR writes DIR/tests-<UTC>.json (fkv.bench.results) ----

_RUN: dict[str, float] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    _RUN["start"] = time.perf_counter()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """With ``FKV_RESULTS_DIR`` set (e.g. ``bench/results`` on the GPU machine), write the run's
    counts (passed/failed/skipped/deselected...), duration, marker expression and machine as a
    result file of bench ``"tests"`` (one case, ``"pytest -m EXPR"``); on the xdist controller
    only."""
    import time

    folder = os.environ.get("FKV_RESULTS_DIR")
    if not folder or hasattr(config, "workerinput") or config.option.collectonly:
        return
    from fkv.bench import results

    stats = terminalreporter.stats
    counts = {f"{key}_count": len(stats.get(key, []))
              for key in ("passed", "failed", "skipped", "xfailed", "xpassed", "deselected")}
    counts["errors_count"] = len(stats.get("error", []))
    markers = config.getoption("markexpr") or ""
    run = results.Run("tests", device="cuda" if HAS_CUDA else "cpu",
                      config={"args": [str(a) for a in config.invocation_params.args],
                              "exit_status": int(exitstatus)})
    run.add(f"pytest -m {markers}" if markers else "pytest",
            params={"markers": markers, "keyword": config.getoption("keyword") or ""},
            metrics={**counts, "duration_s": time.perf_counter() - _RUN.get("start", 0.0)})
    path = results.write(run, results_dir=folder)
    terminalreporter.write_line(f"fkv: test-run summary written to {path}")


@pytest.fixture(scope="session")
def slow_copy():
    """A Triton kernel ``slow_copy[(n // BLOCK,)](out, src, spins, BLOCK=...)`` that lets its
    dependents launch first (the PDL trigger), spins ``spins`` steps, then copies ``src`` into
    ``out``: a producer that ``pdl=True`` kernels after it must wait for (GPU tests)."""
    import triton
    import triton.language as tl

    @triton.jit
    def slow_copy(out_ptr, src_ptr, spins, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(spins):
            acc = acc * 0.5 + 1.0
        x = tl.load(src_ptr + offs)
        tl.store(out_ptr + offs, tl.where(acc > 0.0, x, 0.0).to(x.dtype))

    return slow_copy
