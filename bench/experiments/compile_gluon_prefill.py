"""Compile fkv's warp-specialized Gluon prefill kernel (``fkv/ops/_attention_gluon.py``) for
sm_90a without a GPU, with whichever Triton comes first on ``PYTHONPATH``, and print per tile
shape its shared memory, ``ptxas``'s registers and spills (and the C7512 warning, if the
assembler serialized the warpgroup MMAs) and the ``wgmma.wait_group`` counts of its PTX.

    PYTHONPATH=$T36/site:. python bench/experiments/compile_gluon_prefill.py   # Triton 3.6
    python bench/experiments/compile_gluon_prefill.py                          # this venv's

Run it after changing the kernel, with the GPU machine's Triton and with a newer one, and
without ``TRITON_INTERPRET`` (the interpreter breaks the build): the library falls back to the
Triton kernel when this one does not build, so a build failure would otherwise only show as a
slower prefill.
"""

from __future__ import annotations

import collections
import re

import triton

import fkv
from fkv.ops import _attention_gluon as G
from fkv.ops._spec import cache_strides

#: (block size, query heads per KV head, query tokens per tile): 256 rows each
TILES = ((16, 4, 64), (8, 8, 32), (32, 1, 256), (64, 4, 64))


def ptxas(ptx: str) -> str:
    """``ptxas -v``'s registers, spills and C7512 warning (MMAs serialized for want of
    registers) of an sm_90a PTX, with the ptxas of the Triton on the path."""
    return " ".join(line.split("info    : ")[-1].strip() for line in
                    G.ptxas_report(ptx)[1].splitlines()
                    if "Used" in line or "spill" in line or "C7512" in line)


def compile_one(layout: str, block_size: int, group: int, block_q: int) -> str:
    spec = fkv.KVCacheSpec(layout=layout, num_blocks=1024, block_size=block_size,
                           num_kv_heads=8, head_size=128, dtype="bfloat16")
    ck = G.compile_sm90(block_size=block_size, stride_token=cache_strides(spec)["stride_token"],
                        group=group, block_q=block_q)
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
