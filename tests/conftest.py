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
