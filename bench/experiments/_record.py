"""What the GPU experiments share: the record they write and the pieces they time."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch
import triton


def write(name: str, experiment: str, rows: list[dict[str, Any]]) -> pathlib.Path:
    """Write ``{experiment, device, torch, triton, rows}`` to ``$OUT/name`` (or /tmp)."""
    out = pathlib.Path(os.environ.get("OUT", "/tmp")) / name
    out.write_text(json.dumps({"experiment": experiment,
                               "device": torch.cuda.get_device_name()
                               if torch.cuda.is_available() else "cpu",
                               "torch": torch.__version__, "triton": triton.__version__,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return out


def compiled(kernel: Any) -> dict[str, Any]:
    """Registers, spills and shared memory of a JIT kernel's compiled variant (the last one
    its caches hold: clear ``kernel.device_caches`` before the call that compiles it)."""
    found: dict[str, Any] = {}
    for entry in kernel.device_caches.values():
        for ck in entry[0].values():
            found = {"n_regs": ck.n_regs, "n_spills": ck.n_spills, "shared": ck.metadata.shared}
    return found


def error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


def cudnn_row(problem: Any, layout: str, rep: int) -> dict[str, Any]:
    """The same run's cuDNN SDPA time of a ``fkv.bench.attention.Problem``, as a row."""
    from torch.nn.attention import SDPBackend

    ms = triton.testing.do_bench(lambda: problem.sdpa(SDPBackend.CUDNN_ATTENTION), rep=rep,
                                 return_mode="median")
    row = {"layout": layout, "variant": "sdpa cudnn", "ms": ms}
    print(row, flush=True)
    return row
