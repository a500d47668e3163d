"""The one Triton kernel behind ``move``, ``convert``, ``gather`` and ``scatter``, and its launcher.

Every op of :mod:`fkv.ops.relayout` copies tokens of one layer between two paged views: token ``i``
lives in source block ``src_ids[i // SRC_BLOCK_SIZE]`` slot ``i % SRC_BLOCK_SIZE`` and goes to
destination block ``dst_ids[i // DST_BLOCK_SIZE]`` slot ``i % DST_BLOCK_SIZE``. A program moves one
tile of ``TILE_T`` tokens x ``TILE_H`` heads x ``HEAD_SIZE`` channels of the K or the V half.

The channel axis is innermost (stride 1) in every fkv layout, so every ``(token, head)`` row of a
tile is one contiguous run of ``HEAD_SIZE`` elements on both sides; the tile's dim order follows the
source (``[H, T, C]`` when the source keeps heads outside tokens, ``[T, H, C]`` otherwise) so the
rows a warp loads are adjacent in the source. Each token looks up its own block on each side, so the
same kernel re-chunks between block sizes, gathers random blocks and converts whole caches.

Constexprs (one compile per variant): the two block sizes and the presence of id lists, the number
of heads moved, the head size, the tile sizes and the tile order. Strides, head offsets and the token
count are runtime values taken from the layout algebra (``fkv.ops._spec.cache_strides``). Payloads
are moved as same-width integers (the kernel bitcasts its pointers: a bit-exact copy for any dtype,
fp8 and NaN payloads included). Launches go through :mod:`fkv.ops._launch` (one launch site per move
shape, cached), so a repeated gather costs a dict lookup and a direct launch on the host.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

from fkv.errors import FkvError
from fkv.layout import KVCacheSpec
from fkv.ops._launch import KernelLauncher, LaunchSite
from fkv.ops._spec import cache_constexprs, cache_strides

__all__ = ["launch_move", "move_site", "tile_config"]

#: Bytes one program moves (upper bound). 16 KiB is 128 bytes (32 payload registers) per thread
#: at 4 warps, and leaves enough programs resident per SM to cover DRAM latency.
MAX_TILE_BYTES = 16384
#: Upper bound on the tokens of one tile.
MAX_TILE_T = 32
NUM_WARPS = 4


@triton.jit
def _as_int(ptr, BITS: tl.constexpr):
    """The same address as a pointer to same-width integers (a bit-exact copy of any payload)."""
    if BITS == 8:
        out = ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    elif BITS == 16:
        out = ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    else:
        out = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    return out


@triton.jit
def _layer_base(ptr, table_ptr, layer, layer_stride, TABLE: tl.constexpr, BITS: tl.constexpr):
    """Layer ``layer``'s base as a same-width integer pointer: ``ptr`` (layer 0) plus the layer's
    element offset from it, read from a table (``TABLE``: layers at arbitrary addresses, e.g.
    separate allocations or a peer's mapped caches) or ``layer * layer_stride``."""
    base = _as_int(ptr, BITS)
    if TABLE:
        out = base + tl.load(table_ptr + layer)
    else:
        out = base + layer * layer_stride
    return out


@triton.jit(do_not_specialize=["num_tokens", "src_num_blocks", "dst_num_blocks"])
def _move_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, src_table_ptr, dst_table_ptr, num_tokens,
    src_stride_block, src_stride_kv, src_stride_token, src_stride_head,
    dst_stride_block, dst_stride_kv, dst_stride_token, dst_stride_head,
    src_head_start, dst_head_start, src_num_blocks, dst_num_blocks,
    src_layer_stride, dst_layer_stride,
    SRC_BLOCK_SIZE: tl.constexpr, DST_BLOCK_SIZE: tl.constexpr,
    SRC_IDS: tl.constexpr, DST_IDS: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    TILE_T: tl.constexpr, TILE_H: tl.constexpr, HEADS_OUTER: tl.constexpr,
    MASK_T: tl.constexpr, ELEM_BITS: tl.constexpr,
    KV_HALVES: tl.constexpr, SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_y = tl.program_id(1)
    kv = (pid_y % KV_HALVES).to(tl.int64)
    layer = (pid_y // KV_HALVES).to(tl.int64)
    pid_h = tl.program_id(2)
    src = _layer_base(src_ptr, src_table_ptr, layer, src_layer_stride, SRC_TABLE, ELEM_BITS)
    dst = _layer_base(dst_ptr, dst_table_ptr, layer, dst_layer_stride, DST_TABLE, ELEM_BITS)

    t = pid_t * TILE_T + tl.arange(0, TILE_T)
    t_ok = t < num_tokens
    # A block id outside 0..num_blocks-1 (unchecked ids on the GPU) moves nothing: its tokens are
    # neither read nor written.
    if SRC_IDS:
        src_block = tl.load(src_ids_ptr + t // SRC_BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        t_ok = t_ok & (src_block >= 0) & (src_block < src_num_blocks)
    else:
        src_block = (t // SRC_BLOCK_SIZE).to(tl.int64)
    if DST_IDS:
        dst_block = tl.load(dst_ids_ptr + t // DST_BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        t_ok = t_ok & (dst_block >= 0) & (dst_block < dst_num_blocks)
    else:
        dst_block = (t // DST_BLOCK_SIZE).to(tl.int64)
    # Element offset of each token's row start (int64: caches exceed 2**31 elements).
    src_row = (src_block * src_stride_block + kv * src_stride_kv
               + (t % SRC_BLOCK_SIZE) * src_stride_token)
    dst_row = (dst_block * dst_stride_block + kv * dst_stride_kv
               + (t % DST_BLOCK_SIZE) * dst_stride_token)

    h = pid_h * TILE_H + tl.arange(0, TILE_H)
    h_ok = h < NUM_HEADS
    src_head = (src_head_start + h) * src_stride_head
    dst_head = (dst_head_start + h) * dst_stride_head
    c = tl.arange(0, HEAD_PAD)
    c_ok = c < HEAD_SIZE

    # Only the masks a variant needs: full tiles of the identity (whole-cache convert) load and
    # store unmasked.
    if HEADS_OUTER:  # tile [H, T, C]
        src_off = src_row[None, :, None] + src_head[:, None, None] + c[None, None, :]
        dst_off = dst_row[None, :, None] + dst_head[:, None, None] + c[None, None, :]
        mask = t_ok[None, :, None]
        if NUM_HEADS % TILE_H != 0:
            mask = mask & h_ok[:, None, None]
        if HEAD_PAD != HEAD_SIZE:
            mask = mask & c_ok[None, None, :]
    else:  # tile [T, H, C]
        src_off = src_row[:, None, None] + src_head[None, :, None] + c[None, None, :]
        dst_off = dst_row[:, None, None] + dst_head[None, :, None] + c[None, None, :]
        mask = t_ok[:, None, None]
        if NUM_HEADS % TILE_H != 0:
            mask = mask & h_ok[None, :, None]
        if HEAD_PAD != HEAD_SIZE:
            mask = mask & c_ok[None, None, :]
    if MASK_T or SRC_IDS or DST_IDS or NUM_HEADS % TILE_H != 0 or HEAD_PAD != HEAD_SIZE:
        x = tl.load(src + src_off, mask=mask)
        tl.store(dst + dst_off, x, mask=mask)
    else:
        x = tl.load(src + src_off)
        tl.store(dst + dst_off, x)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def tile_config(num_tokens: int, num_heads: int, head_size: int, itemsize: int, *,
                max_tile_bytes: int = MAX_TILE_BYTES) -> tuple[int, int, int]:
    """``(TILE_T, TILE_H, HEAD_PAD)`` for a move: a tile of at most ``max_tile_bytes`` payload.

    >>> tile_config(262144, 8, 128, 2)     # whole-cache convert, bf16, H=8, D=128
    (16, 4, 128)
    >>> tile_config(13, 1, 576, 2)         # MLA latent (padded to 1024 lanes)
    (8, 1, 1024)
    """
    head_pad = _pow2(head_size)
    elems = max(1, max_tile_bytes // itemsize)
    tile_t = min(_pow2(num_tokens), MAX_TILE_T, max(1, elems // (head_pad * min(_pow2(num_heads), 4))))
    tile_h = min(_pow2(num_heads), max(1, elems // (tile_t * head_pad)))
    return tile_t, tile_h, head_pad


# Per call: the two views, the two id tensors (or placeholders) and the token count.
_LAUNCHER = KernelLauncher(
    _move_kernel, per_call=("src_ptr", "dst_ptr", "src_ids_ptr", "dst_ids_ptr", "src_table_ptr",
                            "dst_table_ptr", "num_tokens"),
    pointers=("src_ptr", "dst_ptr", "src_ids_ptr", "dst_ids_ptr", "src_table_ptr",
              "dst_table_ptr"))


def move_site(src_spec: KVCacheSpec, dst_spec: KVCacheSpec, src_ids_dtype: Any, dst_ids_dtype: Any,
              src_head_start: int, dst_head_start: int, num_heads: int, num_tokens: int, *,
              max_tile_bytes: int | None = None, num_warps: int | None = None,
              layers: tuple[int, Any, Any] = (1, 0, 0)) -> tuple[LaunchSite, tuple[int, int, int]]:
    """The launch site and grid of one move shape (validated inputs; ``num_tokens > 0``).

    ``src_ids_dtype``/``dst_ids_dtype``: the id tensors' dtypes, or None for the identity.
    ``max_tile_bytes``/``num_warps`` default to the module constants (read at call time, so a
    benchmark sweep can set them). Cached: a repeated shape costs one dict lookup. ``layers =
    (count, src, dst)`` moves ``count`` layers in one launch; each side is a layer stride in
    elements (an int: layer ``l`` at ``ptr + l * stride``) or ``"table"`` (layer ``l`` at ``ptr +
    table[l]``: an int64 tensor of element offsets from layer 0, given to :func:`launch_move` as
    ``tables``).
    """
    return _move_site(src_spec, dst_spec, src_ids_dtype, dst_ids_dtype, src_head_start,
                      dst_head_start, num_heads, num_tokens,
                      MAX_TILE_BYTES if max_tile_bytes is None else max_tile_bytes,
                      NUM_WARPS if num_warps is None else num_warps, layers)


@functools.lru_cache(maxsize=1024)
def _move_site(src_spec: KVCacheSpec, dst_spec: KVCacheSpec, src_ids_dtype: Any, dst_ids_dtype: Any,
               src_head_start: int, dst_head_start: int, num_heads: int, num_tokens: int,
               max_tile_bytes: int, num_warps: int, layers: tuple[int, Any, Any] = (1, 0, 0)
               ) -> tuple[LaunchSite, tuple[int, int, int]]:
    sc, dc = cache_constexprs(src_spec), cache_constexprs(dst_spec)
    ss, ds = cache_strides(src_spec), cache_strides(dst_spec)
    tile_t, tile_h, head_pad = tile_config(num_tokens, num_heads, sc["HEAD_SIZE"], src_spec.itemsize,
                                           max_tile_bytes=max_tile_bytes)
    if ss["stride_dim"] != 1 or ds["stride_dim"] != 1:
        raise FkvError(f"move: the channel axis must be innermost on both sides (stride_dim "
                       f"{ss['stride_dim']} and {ds['stride_dim']}); fkv layouts always have it")
    kv_halves = 1 if sc["IS_MLA"] else 2
    count, src_layers, dst_layers = layers
    grid = (triton.cdiv(num_tokens, tile_t), kv_halves * count, triton.cdiv(num_heads, tile_h))
    fixed = dict(
        src_stride_block=ss["stride_block"], src_stride_kv=ss["stride_kv"],
        src_stride_token=ss["stride_token"], src_stride_head=ss["stride_head"],
        dst_stride_block=ds["stride_block"], dst_stride_kv=ds["stride_kv"],
        dst_stride_token=ds["stride_token"], dst_stride_head=ds["stride_head"],
        src_head_start=src_head_start, dst_head_start=dst_head_start,
        src_num_blocks=src_spec.num_blocks, dst_num_blocks=dst_spec.num_blocks,
        src_layer_stride=0 if src_layers == "table" else int(src_layers),
        dst_layer_stride=0 if dst_layers == "table" else int(dst_layers),
        SRC_BLOCK_SIZE=sc["BLOCK_SIZE"], DST_BLOCK_SIZE=dc["BLOCK_SIZE"],
        SRC_IDS=src_ids_dtype is not None, DST_IDS=dst_ids_dtype is not None,
        NUM_HEADS=num_heads, HEAD_SIZE=sc["HEAD_SIZE"], HEAD_PAD=head_pad,
        TILE_T=tile_t, TILE_H=tile_h, HEADS_OUTER=sc["HEADS_OUTER"],
        MASK_T=num_tokens % tile_t != 0, ELEM_BITS=8 * src_spec.itemsize,
        KV_HALVES=kv_halves, SRC_TABLE=src_layers == "table", DST_TABLE=dst_layers == "table",
    )
    return _LAUNCHER.site(fixed, {"num_warps": num_warps}), grid


def launch_move(src: Any, src_spec: KVCacheSpec, src_ids: Any, src_head_start: int,
                dst: Any, dst_spec: KVCacheSpec, dst_ids: Any, dst_head_start: int,
                num_heads: int, num_tokens: int, *, max_tile_bytes: int | None = None,
                num_warps: int | None = None, layers: tuple[int, Any, Any] = (1, 0, 0),
                tables: tuple[Any, Any] = (None, None)) -> None:
    """Launch the kernel on validated inputs (``fkv.ops.convert`` checks everything first).

    ``src``/``dst`` are one layer's logical views of their specs (or any tensor with the same
    data pointer, e.g. a contiguous staging buffer); ``src_ids``/``dst_ids`` are contiguous int32/
    int64 tensors on the views' device, or None for the identity (block ``j`` is block ``j``).
    Ids outside ``0..num_blocks-1`` move nothing (masked in the kernel). ``layers``: see
    :func:`move_site`; ``tables``: the int64 element-offset tensors of its ``"table"`` sides.
    """
    if num_tokens <= 0:
        return
    site, grid = move_site(src_spec, dst_spec, None if src_ids is None else src_ids.dtype,
                           None if dst_ids is None else dst_ids.dtype, src_head_start,
                           dst_head_start, num_heads, num_tokens, max_tile_bytes=max_tile_bytes,
                           num_warps=num_warps, layers=layers)
    site(grid, move_args(src, src_ids, dst, dst_ids, tables, num_tokens))


def move_args(src: Any, src_ids: Any, dst: Any, dst_ids: Any, tables: tuple[Any, Any],
              num_tokens: int) -> tuple[Any, ...]:
    """The kernel's per-call arguments (:data:`_LAUNCHER`'s order); placeholders the kernel never
    reads stand in for absent id lists and tables."""
    src_table, dst_table = tables
    return (src, dst, src if src_ids is None else src_ids, src if dst_ids is None else dst_ids,
            src if src_table is None else src_table, src if dst_table is None else dst_table,
            num_tokens)
