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
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_interp = pytest.mark.skip(reason="CUDA present: kernels run on the GPU (gpu marker), "
                                   "not in the CPU interpreter")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and HAS_CUDA:
            item.add_marker(skip_interp)


@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.interpreter),
                        pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Kernel tests take this: CPU under the Triton interpreter (CI), or CUDA under ``gpu``."""
    return request.param
