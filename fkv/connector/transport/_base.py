"""What the transport's server and client share: results, errors, defaults, cache checks, kernels.

``cache_regions`` turns ``fkv.allocate``-style views into NIXL regions (checking shape, dtype,
strides, device and storage); ``kernels`` picks the Triton ops (CUDA, or CPU under
``TRITON_INTERPRET=1``) or the torch references; ``on_device`` makes a tensor's GPU the current one
for a block (kernels launch on the current device, and the server packs from its own thread).

>>> ReadResult(True, "req-1", 512, 2, 0.001).strategy
''
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import attrs

from fkv.connector.handshake import EngineDesc
from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec

__all__ = [
    "DEFAULT_LEASE", "DEFAULT_PACK_BYTES", "DEFAULT_PACK_THRESHOLD", "DEFAULT_STAGING_BYTES",
    "HandshakeRejected", "ReadResult", "STRATEGIES", "SideChannelError", "Tally", "TransferFailed",
    "cache_regions", "check_curve", "check_engine", "check_seconds", "kernels", "layer_views",
    "load_nixl", "on_device", "process_alive", "spin_seconds",
    "split_chunks", "tensor_memory", "zmq",
]

#: Seconds a prefill rank holds a request's blocks waiting for notifications (configurable).
DEFAULT_LEASE = 120.0
#: Default decode-side staging capacity (bytes) for staging and packed reads; larger reads go in
#: chunks.
DEFAULT_STAGING_BYTES = 128 << 20
#: Default prefill-side pack (send-staging) buffer, capped at the size of the rank's caches.
DEFAULT_PACK_BYTES = 256 << 20
#: ``strategy="auto"`` packs a request (on CUDA) whose plan needs more descriptors than this.
DEFAULT_PACK_THRESHOLD = 64
#: What ``connect(strategy=...)`` takes.
STRATEGIES = ("auto", "ipc", "nixl", "packed", "direct", "staging")


class TransferFailed(FkvError):
    """A transfer failed or did not finish in time (the peer died, hung or refused)."""


class SideChannelError(FkvError):
    """The side channel failed: no answer in time, or an answer we refuse."""


class HandshakeRejected(FkvError):
    """``connect`` refused the pair: ``reasons`` holds every :class:`~fkv.connector.Reason`."""

    def __init__(self, message: str, reasons: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.reasons = reasons


@attrs.frozen
class ReadResult:
    """Outcome of ``Client.read``. ``ok`` only when every READ finished, the staging/unpack moves
    ran and the prefill ranks were notified; ``bytes`` moved by finished READs; ``descriptors`` the
    descriptors posted (direct/staging: the plan's coalesced rows; packed: one per prefill rank per
    chunk); ``error`` says what failed (None when ok); ``seconds`` the whole call,
    ``transfer_seconds`` the part spent posting READs and waiting for them; ``strategy`` the path
    this request took (``"ipc"``, ``"packed"``, ``"direct"`` or ``"staging"``; ``"none"``: a full
    prefix hit, empty block lists, only notified); ``pack_seconds`` (packed) the
    time from asking the prefill ranks to pack until every one replied; ``layer_seconds`` when
    each layer landed, from the start of the read (a streaming read lands layers as they are
    published; otherwise every layer lands at the end). A failed read claims no layer."""

    ok: bool
    request_id: str
    bytes: int
    descriptors: int
    seconds: float
    error: str | None = None
    transfer_seconds: float = 0.0  # of ``seconds``: posting the READs until they were DONE
    strategy: str = ""
    pack_seconds: float = 0.0
    layer_seconds: tuple[float, ...] = ()  # when each layer landed, from the read's start


def layer_views(spec: KVCacheSpec, caches: Any) -> list[Any]:
    """The per-layer views of ``caches`` (a list, or one tensor for one layer)."""
    if not isinstance(spec, KVCacheSpec):
        raise field_error("spec", spec, "a KVCacheSpec")
    if hasattr(caches, "shape"):
        caches = [caches]
    try:
        views = list(caches)
    except TypeError:
        raise field_error("caches", type(caches).__name__,
                          "the list of per-layer views fkv.allocate(spec) returns") from None
    if len(views) != spec.num_layers:
        raise field_error("caches", f"{len(views)} views", f"{spec.num_layers} views (spec.num_layers)",
                          "pass the list fkv.allocate(spec, device) returns")
    return views


def cache_regions(spec: KVCacheSpec, caches: Any) -> tuple[list[tuple[int, int]], str, int, Any]:
    """``(regions, mem_type, device_id, device)`` of ``fkv.allocate``-style views of ``spec``.

    Checks shape, dtype, strides (the layout is read from the tensors, never trusted; a size-1
    dim's stride is not compared, as :func:`fkv.infer_spec` and the kernels do not), device and
    that each region's bytes really lie in the tensor's storage.
    """
    from fkv.layout import strides_match
    from fkv.tensors import torch_dtype

    views = layer_views(spec, caches)
    dtype = torch_dtype(spec.dtype)
    device = views[0].device
    for i, t in enumerate(views):
        if not hasattr(t, "stride"):
            raise field_error(f"caches[{i}]", type(t).__name__, "a torch.Tensor")
        if tuple(t.shape) != spec.logical_shape or t.dtype != dtype:
            raise field_error(f"caches[{i}]", f"shape {tuple(t.shape)} dtype {t.dtype}",
                              f"shape {spec.logical_shape} dtype {dtype} (the spec's logical view)")
        if not strides_match(spec.element_strides, spec.logical_shape, tuple(t.stride())):
            raise field_error(f"caches[{i}].stride()", tuple(t.stride()),
                              f"{spec.element_strides} (the {spec.layout.value} layout of the spec)",
                              "allocate caches with fkv.allocate(spec), or pass the spec "
                              "fkv.infer_spec derives from them")
        if t.device != device:
            raise field_error(f"caches[{i}].device", str(t.device), f"{device} like caches[0]")
    mem_type, device_id = tensor_memory(views[0])
    item = spec.itemsize
    if spec.cross_layer:
        base = views[0].data_ptr()
        for layer, t in enumerate(views):
            want = base + layer * spec.layer_stride * item
            if t.data_ptr() != want:
                raise field_error(f"caches[{layer}]", f"data at 0x{t.data_ptr():x}",
                                  f"layer {layer} of one cross-layer buffer at 0x{want:x}")
        regions = [(base, spec.region_bytes)]
        starts = [views[0]]
    else:
        regions = [(t.data_ptr(), spec.region_bytes) for t in views]
        starts = views
    for i, t in enumerate(starts):
        room = t.untyped_storage().nbytes() - t.storage_offset() * item
        if room < spec.region_bytes:
            raise field_error(f"caches[{i}]", f"a view with {room} bytes of storage",
                              f"{spec.region_bytes} bytes (spec.region_bytes)")
    return regions, mem_type, device_id, device


def check_engine(engine: Any) -> EngineDesc:
    if not isinstance(engine, EngineDesc):
        raise field_error("engine", type(engine).__name__, "an fkv.connector.EngineDesc")
    return engine


def check_seconds(name: str, value: Any) -> float:
    """``value`` as float seconds: a finite number > 0 (a NaN or infinite deadline never expires,
    so nothing bounded by it could be promised to end)."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not (math.isfinite(value) and value > 0):
        raise field_error(name, value, "a finite positive number of seconds")
    return float(value)


def check_curve(curve: Any, *, client: bool) -> Any:
    """``curve`` for the side channel: None (plain-TCP frames) or a ``CurveKeys``; a ``client``
    (one that connects: a decode rank, a prefill rank > 0 publishing to rank 0) also needs
    ``curve.server``. Only the type is named, never the value: it may hold secret keys."""
    from fkv.connector.transport._sidelimits import CurveKeys

    if curve is None:
        return None
    if not isinstance(curve, CurveKeys):
        raise field_error("curve", type(curve).__name__,
                          "None (plain TCP) or an fkv.connector.CurveKeys",
                          "make keys with fkv.connector.curve_keypair()")
    if client and curve.server is None:
        raise field_error("curve.server", None, "the server's public key (Z85, 40 bytes)",
                          "pass CurveKeys(public, secret, server=<server public key>)")
    return curve


def zmq() -> Any:
    """The ``zmq`` module (pyzmq), with a clear error when it is missing."""
    try:
        import zmq as module
    except ImportError as e:  # pragma: no cover - pyzmq is a declared dependency
        raise FkvError("the fkv side channel needs pyzmq: pip install pyzmq") from e
    return module


def kernels(device: Any) -> SimpleNamespace:
    """``move``/``gather``/``scatter`` for caches on ``device``: the Triton kernels on CUDA (or on
    CPU under ``TRITON_INTERPRET=1``), else the torch references (CPU DRAM)."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from fkv.ops import gather, move, scatter
    else:
        from fkv.ops.reference import gather, move, scatter
    return SimpleNamespace(move=move, gather=gather, scatter=scatter)


@contextlib.contextmanager
def on_device(device: Any, sync: bool = True) -> Iterator[None]:
    """Make ``device`` (a CUDA device) the current one inside the block and (``sync``) wait for
    its work at the end; nothing for CPU."""
    if device.type != "cuda":
        yield
        return
    import torch

    with torch.cuda.device(device):
        yield
        if sync:
            torch.cuda.current_stream(device).synchronize()


def spin_seconds() -> float:
    """``FKV_TRANSPORT_SPIN``: seconds the transport busy-polls (side channel, READ states, the
    server loop after a request) before it sleeps; 0 (default) sleeps at once. Spinning trades a
    CPU core for the wake-up latency of sleeping threads."""
    try:
        return max(0.0, float(os.environ.get("FKV_TRANSPORT_SPIN", "0") or 0))
    except ValueError:
        return 0.0


_NIXL: Any = None


def load_nixl() -> Any:
    """``import nixl`` with its Python logging turned down to warnings (it logs to stdout)."""
    global _NIXL
    if _NIXL is None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        try:
            import nixl
        except ImportError as e:  # pragma: no cover - nixl is a declared dependency
            raise FkvError(f"fkv transfers need NIXL: pip install nixl ({e})") from e
        _NIXL = nixl
    return _NIXL


def tensor_memory(t: Any) -> tuple[str, int]:
    """``(mem_type, device_id)`` NIXL uses for a tensor: ``("VRAM", gpu)`` or ``("DRAM", 0)``."""
    if t.device.type == "cuda":
        return "VRAM", int(t.device.index or 0)
    if t.device.type == "cpu":
        return "DRAM", 0
    raise FkvError(f"'caches' must live on a CPU or CUDA device (got {t.device})")


@attrs.define
class Tally:
    """What one read did so far (for its :class:`ReadResult`)."""

    bytes: int = 0
    descriptors: int = 0
    transfer_seconds: float = 0.0
    pack_seconds: float = 0.0


def split_chunks(local: Any, remote: Any, tokens: int, per: int, nl: int, nr: int
                 ) -> list[tuple[Any, Any, int]]:
    """``(local ids, remote ids, tokens)`` pieces of at most ``per`` tokens (a multiple of both
    block sizes), each piece's ids exactly the blocks of its tokens."""
    if tokens <= per:
        return [(local, remote, tokens)]
    out = []
    for start in range(0, tokens, per):
        n = min(per, tokens - start)
        out.append((local[start // nl: -(-(start + n) // nl)],
                    remote[start // nr: -(-(start + n) // nr)], n))
    return out


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (a peer's claim, checked by the wire decoder) still exists; one
    that cannot be asked about (not a valid pid here) counts as gone."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (OSError, OverflowError, ValueError):  # ProcessLookupError, out of range
        return False
    return True
