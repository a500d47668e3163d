"""Compile fkv's warp-specialized Gluon prefill kernel (``fkv/ops/_attention_gluon.py``) for
sm_90a without a GPU, with whichever Triton comes first on ``PYTHONPATH``, and print per tile
shape its shared memory, ``ptxas``'s registers and spills (and the C7512 warning, if the
assembler serialized the warpgroup MMAs) and the ``wgmma.wait_group`` counts of its PTX.

    PYTHONPATH=$T36/site:. python bench/experiments/compile_gluon_prefill.py   # Triton 3.6
    python bench/experiments/compile_gluon_prefill.py                          # this venv's

Run it after changing the kernel, with the GPU machine's Triton and with a newer one: the
library falls back to the Triton kernel when this one does not build, so a build failure would
otherwise only show as a slower prefill.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nv
from triton.experimental.gluon._runtime import GluonASTSource

import fkv
from fkv.ops import _attention_gluon as G
from fkv.ops._spec import cache_strides

#: (block size, query heads per KV head, query tokens per tile): 256 rows each
TILES = ((16, 4, 64), (8, 8, 32), (32, 1, 256), (64, 4, 64))
POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
            "qsl_ptr": "*i32", "out_ptr": "*bf16"}


def ptxas(ptx: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([nv.get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True)
    """``ptxas -v``'s registers, spills and C7512 warning (MMAs serialized for want of
    registers) of an sm_90a PTX, with the ptxas of the Triton on the path."""
    return " ".join(line.split("info    : ")[-1].strip() for line in
                    (res.stdout + res.stderr).splitlines()
                    if "Used" in line or "spill" in line or "C7512" in line)


def signature(kernel: Any, consts: dict[str, Any]) -> tuple[dict[str, str], dict]:
    """The (signature, attributes) of a prefill Gluon kernel for an offline compile: bf16 and
    int32 pointers and the strides 16-divisible, as the JIT specializes them on a real launch."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "score_mult":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name != "stride_bt":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_one(layout: str, block_size: int, group: int, block_q: int) -> str:
    spec = fkv.KVCacheSpec(layout=layout, num_blocks=1024, block_size=block_size,
                           num_kv_heads=8, head_size=128, dtype="bfloat16")
    st = cache_strides(spec)
    consts = dict(BLOCK_SIZE=block_size, STRIDE_TOKEN=st["stride_token"], NUM_HEADS=8, HEAD=128,
                  GROUP=group, HPP=group, HEAD_CHUNKS=1, BLOCK_Q=block_q, TILE_N=G.TILE_N,
                  STAGES=G.STAGES, CONSUMER_REGS=G.CONSUMER_REGS,
                  PRODUCER_REGS=G.PRODUCER_REGS)
    kernel = G._prefill_ws_kernel
    sig, attrs = signature(kernel, consts)
    ck = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    waits = collections.Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)",
                                           ck.asm["ptx"]))
    return (f"shared {ck.metadata.shared} B; {ptxas(ck.asm['ptx'])}; "
            f"wgmma waits {dict(sorted(waits.items()))}")


def main() -> None:
    print(f"triton {triton.__version__}, Gluon {'available' if G.available() else 'missing'}")
    for layout in ("NHD", "HND"):
        for block_size, group, block_q in TILES:
            try:
                info = compile_one(layout, block_size, group, block_q)
            except Exception as e:  # noqa: BLE001 - report which tile fails, go on
                info = f"FAILED {type(e).__name__}: {str(e).splitlines()[-1][:300]}"
            print(f"{layout} block {block_size} group {group} block_q {block_q}: {info}",
                  flush=True)


if __name__ == "__main__":
    main()
