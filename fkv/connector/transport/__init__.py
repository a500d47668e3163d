"""Real prefill -> decode transfers: NIXL READs planned by the handshake, a ZMQ side channel.

Prefill side, on every rank (rank 0 answers the side channel for the whole engine)::

    server = fkv.connector.serve(engine, spec, caches)                      # rank 0
    server = fkv.connector.serve(engine, spec, caches, join=rank0_address)  # ranks 1..tp-1
    server.hold(request_id, block_ids)   # held until its decode readers notified, or the lease ends
    server.pending()                     # request ids whose blocks are still held

Decode side, on every rank::

    with fkv.connector.connect(engine, spec, caches, remote_address=rank0_address) as client:
        result = client.read(request_id, local_block_ids, remote_block_ids)
        assert result.ok, result.error

``connect`` fetches every prefill rank's metadata through rank 0 (peer bytes go through
``fkv.connector.wire.decode_untrusted`` only), runs :func:`fkv.connector.handshake` (a
:class:`HandshakeRejected` carries every reason), registers the local cache regions once and
prepares what each path needs once. ``read`` checks the block ids against both caches before
anything moves and takes one of four paths (``ReadResult.strategy``):

- ``ipc``: prefill and decode are CUDA processes of one host and the decode GPU can reach the
  prefill GPU: the decode rank maps the prefill caches (CUDA IPC, once per connection) and one
  ``fkv.ops`` kernel per prefill rank moves every layer of the request straight into its cache
  (head slice, layout, backend and block size converted in the same pass);
- ``packed``: each prefill rank gathers the request (its blocks, the decode rank's heads, every
  layer) into its registered pack buffer when the decode rank asks on the side channel; the
  decode rank READs it as one descriptor and scatters it into its cache;
- ``direct``: the plan's rows land final bytes in the local cache (one NIXL descriptor per row);
- ``staging``: the plan's rows read whole pages into a registered staging buffer, then
  ``fkv.ops.move`` rearranges them (layout, head slice, block size).

On one host with CPU DRAM caches on both sides, ``direct`` and ``staging`` copy the plan's rows
with ``process_vm_readv`` instead of NIXL READs (``_cma``; ``FKV_CMA=0`` or
``strategy="nixl"`` keep NIXL READs).

``connect(..., strategy=)``: ``"auto"`` (default) takes ``ipc`` whenever it applies, else packs a
request whose plan needs more than ``pack_threshold`` descriptors when both sides' caches are on
CUDA, else follows the plan (direct or staging); ``"nixl"`` is ``"auto"`` without ``ipc``;
``"ipc"``/``"packed"``/``"direct"``/``"staging"`` force a path (refused at connect, with the
reason, when impossible). ``client.describe()`` names the paths and why the others are off.
``read`` waits for the copies within ``timeout``, then notifies the prefill ranks
(``fkv1|<request id>|<decode engine id>|<decode rank>|done``, also the ``notify_only_ranks``;
empty block lists, a full prefix hit, only notify). It returns a
:class:`ReadResult`; ``ok`` is True only when every byte landed.

Caches are ``fkv.allocate(spec, device)`` views (CPU DRAM or CUDA VRAM). NIXL is only ever called
from one thread at a time per agent: the server's own thread after start-up (it also does the
packing, between polls), the client under its lock.

Environment knobs: ``FKV_TRANSPORT_SPIN`` (seconds; default 0) busy-polls the side channel, READ
states and the server loop that long before sleeping (at the cost of a busy core per rank);
``FKV_PACK_DESCRIPTORS`` splits each pack READ in that many descriptors (default 1);
``FKV_CMA=0`` turns same-host CPU copies off, ``FKV_CMA_THREADS`` (default 4) splits a large one,
``FKV_CMA_DIRECT_ROWS`` (default 1024) bounds the staging-plan requests copied as direct rows;
``FKV_STAGING_WINDOW=0`` reads a request larger than the staging buffer in chunks of blocks;
``FKV_OUTBOX=0`` turns same-host outboxes off;
``FKV_NIXL_PROGRESS_THREAD`` / ``FKV_NIXL_NUM_THREADS`` (see ``_agent.Agent``).

Modules, bottom to top (each imports only those above it in this list): ``_base`` (errors,
results, cache checks), ``_side`` (the ZMQ messages), ``_agent`` (the NIXL agent), ``_ipc`` (CUDA
IPC export and mapping), ``_cma`` (same-host CPU copies), ``_packer`` (prefill pack buffer),
``_link`` (a connection's NIXL state),
the paths ``_plan_path``, ``_packed_path``, ``_ipc_path``, then ``_connection`` (the one place that
picks a request's path), ``_server`` (prefill ranks) and ``_client`` (decode ranks).

>>> import fkv, torch
>>> from fkv.connector import EngineDesc, serve, connect
>>> spec = fkv.KVCacheSpec(layout="HND", num_blocks=4, block_size=4, num_kv_heads=2, head_size=8)
>>> p = EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=2)
>>> d = EngineDesc(engine_id="d", tp_size=1, tp_rank=0, total_num_kv_heads=2)
>>> src, dst = fkv.allocate(spec), fkv.allocate(spec)
>>> _ = src[0].copy_(torch.randn(src[0].shape))
>>> with serve(p, spec, src) as server, connect(d, spec, dst, remote_address=server.address) as c:
...     result = c.read("req-1", [2, 0], [1, 3])
>>> result.ok, result.bytes, result.strategy, torch.equal(dst[0][2], src[0][1])
(True, 512, 'direct', True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fkv.connector.handshake import EngineDesc
from fkv.connector.transport._base import (
    DEFAULT_LEASE,
    DEFAULT_PACK_THRESHOLD,
    DEFAULT_STAGING_BYTES,
    HandshakeRejected,
    ReadResult,
    SideChannelError,
    TransferFailed,
    cache_regions,
)
from fkv.connector.transport._client import Client
from fkv.connector.transport._server import Server
from fkv.connector.transport._sidelimits import CurveKeys, curve_keypair
from fkv.layout import KVCacheSpec

__all__ = [
    "Client", "CurveKeys", "HandshakeRejected", "ReadResult", "Server", "SideChannelError",
    "TransferFailed", "cache_regions", "connect", "curve_keypair", "serve",
]


def serve(engine: EngineDesc, spec: KVCacheSpec, caches: Any, *, host: str = "127.0.0.1",
          port: int = 0, join: str | None = None, lease: float = DEFAULT_LEASE,
          join_timeout: float = 30.0,
          on_release: Callable[[str, Any, str], None] | None = None,
          pack_bytes: int | None = None, curve: Any = None) -> Server:
    """Expose one prefill rank's caches; a context manager with ``.address``.

    Rank 0 binds the side channel on ``host:port`` (``port=0``: any free port) and answers for the
    whole engine; ranks ``1..tp-1`` pass ``join=<rank 0's address>`` and publish their metadata
    through it (retrying for ``join_timeout`` seconds). ``caches``: the per-layer views
    ``fkv.allocate(spec, device)`` returns (``[NB, 2, N, H, D]`` each for triton/flashinfer,
    ``[2, NB, N, H, D]`` flash_attn, ``[NB, N, D]`` mla). A request's blocks are held until the
    expected decode readers notified (each its ``fkv1|<request id>|<engine id>|<rank>|done``), or
    ``lease`` seconds after :meth:`Server.hold` (a notification for a request nobody holds is
    refused); ``on_release(request_id, block_ids, why)`` is
    called from the server's thread when that happens.

    ``pack_bytes``: the registered pack buffer packed reads gather into, on the caches' device
    (default: 256 MiB or the caches' size, whichever is smaller; 0: no packed reads). Every rank
    with one also binds ``host`` (any free port) to answer pack requests.

    ``curve``: None (plain-TCP frames) or a :class:`CurveKeys` for a CURVE-authenticated ZMQ side
    channel (ranks ``1..tp-1`` also need ``server=``, rank 0's public key). Bad arguments raise
    FkvError before anything is bound or registered.

    >>> import fkv
    >>> from fkv.connector import EngineDesc
    >>> spec = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8)
    >>> engine = EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=1)
    >>> with serve(engine, spec, fkv.allocate(spec)) as server:
    ...     server.hold("req-1", [0, 1]); sorted(server.pending()), server.pack_bytes
    (['req-1'], 256)
    """
    return Server(engine, spec, caches, host=host, port=port, join=join, lease=lease,
                  join_timeout=join_timeout, on_release=on_release, pack_bytes=pack_bytes,
                  curve=curve)


def connect(engine: EngineDesc, spec: KVCacheSpec, caches: Any, *, remote_address: str,
            timeout: float = 10.0, expected_engine: str | None = None, strategy: str = "auto",
            staging_bytes: int = DEFAULT_STAGING_BYTES, telemetry: bool = False,
            pack_threshold: int = DEFAULT_PACK_THRESHOLD, curve: Any = None) -> Client:
    """Connect one decode rank to a prefill engine through its rank-0 side channel.

    Fetches every prefill rank's metadata within ``timeout`` seconds (waiting for ranks still
    joining), runs the handshake (raises :class:`HandshakeRejected`, an FkvError whose ``reasons``
    lists every reason), and prepares NIXL descriptors once. ``caches``: the per-layer views
    ``fkv.allocate(spec, device)`` returns. ``expected_engine`` checks the prefill engine id;
    ``strategy``: ``"auto"``, ``"nixl"`` (auto without ipc), or force ``"ipc"``, ``"packed"``,
    ``"direct"`` or ``"staging"`` (see the module docstring); ``pack_threshold``: ``"auto"`` packs requests needing more descriptors than this
    (CUDA on both sides); ``staging_bytes`` caps the registered staging buffer (staging and packed
    reads; larger reads go in chunks); ``telemetry`` (a bool) turns on NIXL's transfer telemetry;
    ``curve``: None (plain-TCP frames) or a :class:`CurveKeys` with ``server=``, the prefill side
    channel's public key. ``timeout`` must be finite and positive.
    ``client.describe()`` says what the client will do.

    >>> import fkv
    >>> from fkv.connector import EngineDesc
    >>> spec = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    >>> e = lambda name: EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)
    >>> with serve(e("p"), spec, fkv.allocate(spec)) as s:
    ...     try:
    ...         connect(e("d"), spec.evolve(head_size=16), fkv.allocate(spec.evolve(head_size=16)),
    ...                 remote_address=s.address)
    ...     except HandshakeRejected as err:
    ...         [r.code for r in err.reasons]
    ['head_size']
    """
    return Client(engine, spec, caches, remote_address=remote_address, timeout=timeout,
                  expected_engine=expected_engine, strategy=strategy, staging_bytes=staging_bytes,
                  telemetry=telemetry, pack_threshold=pack_threshold, curve=curve)
