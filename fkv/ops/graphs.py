"""A start-up recipe for CUDA graphs: :func:`graph_primer`.

On an H200 (driver 580, CUDA 13, torch 2.11) a process's ``torch.cuda.graph`` replays settle in
one of two states for their whole life: in the usual one an empty kernel node costs about 1.27 us
and a 256-token decode ``write_kv`` 2.50 us per call; in the other 0.95 us and 2.14 us. Which
one a process gets did not depend on clocks, stream priorities, ``CUDA_DEVICE_MAX_CONNECTIONS``,
module loading or torch's instantiate flags (bench/results/raw/graph-state-20261204T2140/ for the
figures above; bench/NOTES.md, 2026-12-04 and 2026-12-05). One
order reached the faster state in every process tried: a one-node graph instantiated for device
launch before the process captures its graphs, then launched once after they were captured.
:func:`graph_primer` is that order as a context manager::

    with fkv.ops.graph_primer():      # before the process captures any other graph
        ...capture the decode graphs (torch.cuda.graph)...
    # the primer has been launched once; replay the graphs as usual

Measured on the H200 (bench/results/raw/graph-recipe-20261205T0420/): 40 graphs of 32 decode
writes on one pool, as an engine captures them, replayed at 2.44-2.46 us per write without the
primer and 2.09-2.11 us with it (two fresh processes each). ``fkv bench write`` captures its
decode graphs inside one primer in a child process: on the H200 2.10-2.13 us per write, bf16 and
fp8 (bench/results/write-20261205T104625Z.json); on an H100 (80GB HBM3, same driver) 2.21-2.28 us
against 2.57-2.62 in its usual state (one case, bf16 NHD, read 2.27 unprimed;
bench/results/write-20261205T054338Z.json).
Capture every graph inside one block: on that H100, three captures each inside a primer of its
own gave two fast graphs and a slow third (2.27, 2.27, 2.64 us), while a primer entered after
two other graphs had been captured and dropped still gave 40 fast ones (2.27-2.28 us;
bench/results/raw/graph-primer-late-20261205T0543/); on the H200 a primer entered late did not
help in an earlier, different experiment (``graph_prime.py``, 2026-12-04).

Why the driver behaves so is not known; the recipe is measured, not documented by NVIDIA, so
check it on your GPU (``bench/experiments/graph_state.py``) before relying on it. The primer
(one 4-byte tensor and one executable graph) lives until the process exits.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

from fkv.errors import FkvError

__all__ = ["graph_primer"]

# cudaGraphInstantiateFlagDeviceLaunch / CU_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH
_DEVICE_LAUNCH = 4
# Primers stay alive with the process: whether destroying one gives the state back is not known.
_PRIMERS: list[Any] = []


class _Primer:
    """A one-node graph (``add_`` on a scalar) captured by torch, instantiated through the CUDA
    driver for device launch and uploaded."""

    def __init__(self, device: Any) -> None:
        import torch

        self.driver = ctypes.CDLL("libcuda.so.1")
        self.driver.cuGraphInstantiateWithFlags.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong]
        self.driver.cuGraphUpload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.driver.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.device = device
        with torch.cuda.device(device):
            self.x = torch.zeros(1, device=device)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            self.graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(self.graph, stream=stream):
                self.x.add_(1)
            torch.cuda.synchronize()
            exe = ctypes.c_void_p()
            self._check("cuGraphInstantiateWithFlags", self.driver.cuGraphInstantiateWithFlags(
                ctypes.byref(exe), self.graph.raw_cuda_graph(), _DEVICE_LAUNCH))
            self.exe = exe
            self._check("cuGraphUpload", self.driver.cuGraphUpload(
                self.exe, torch.cuda.current_stream().cuda_stream))
            torch.cuda.synchronize()

    @staticmethod
    def _check(call: str, rc: int) -> None:
        if rc:
            raise FkvError(f"graph_primer: {call} returned CUDA error {rc}, expected 0 "
                           "(CUDA_SUCCESS)")

    def launch(self) -> None:
        import torch

        with torch.cuda.device(self.device):
            self._check("cuGraphLaunch", self.driver.cuGraphLaunch(
                self.exe, torch.cuda.current_stream().cuda_stream))
            torch.cuda.synchronize()


@contextlib.contextmanager
def graph_primer(device: Any = None) -> Iterator[None]:
    """Capture the process's CUDA graphs inside this block: a device-launch primer graph is
    instantiated on entry and launched once on a clean exit (module docstring: the measured
    effect and what is not known). ``device``: a CUDA device (default: the current one).

    Raises FkvError without CUDA, or naming the driver call and its error code.
    """
    import torch

    if not torch.cuda.is_available():
        raise FkvError("graph_primer: needs a CUDA device (torch.cuda.is_available() is False)")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else \
        torch.device(device)
    if device.type != "cuda":
        raise FkvError(f"graph_primer: device must be a CUDA device (got {str(device)!r})")
    primer = _Primer(device)
    _PRIMERS.append(primer)
    yield
    primer.launch()
