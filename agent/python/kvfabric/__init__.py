"""kvfabric: attach a serving engine's KV cache to its node's kvfabric agent.

A pure client of the agent's engine API (gRPC over the agent's Unix socket,
agent/proto/kvfabric/v1/engine.proto)::

    import kvfabric

    layout = kvfabric.Layout.for_model(layers=32, num_blocks=1024,
                                       total_kv_heads=8, head_dim=128)
    pool = kvfabric.ShmPool.for_layout(layout)
    client = kvfabric.Client("/run/kvfabric/engine.sock")
    with client.attach("prefill-0", "", "prefill", layout) as session:
        session.register_shm(pool)
        r = session.transfer_blocks(1, "decode-0", [3, 4], [10, 11])
        assert r.ok, r.reason
"""

from .client import (
    DEFAULT_SOCKET_DIR,
    ArrivalResult,
    Client,
    InFlight,
    Session,
    SessionStatus,
    TransferResult,
    engine_socket,
)
from .errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvfabricError,
    NotFound,
    ProtocolError,
    SessionClosed,
    Timeout,
    Unavailable,
    Unimplemented,
)
from .layout import Layout, canonical_gpu_uuid, dtype_bytes
from .shm import ShmPool, unlink_shm
from .torch_pool import CudaIpcPool, gpu_uuid, torch_pool_from_tensor

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists",
    "ArrivalResult",
    "canonical_gpu_uuid",
    "Client",
    "CudaIpcPool",
    "DEFAULT_SOCKET_DIR",
    "dtype_bytes",
    "engine_socket",
    "FailedPrecondition",
    "gpu_uuid",
    "InFlight",
    "InvalidArgument",
    "KvfabricError",
    "Layout",
    "NotFound",
    "ProtocolError",
    "Session",
    "SessionClosed",
    "SessionStatus",
    "ShmPool",
    "Timeout",
    "torch_pool_from_tensor",
    "TransferResult",
    "Unavailable",
    "Unimplemented",
    "unlink_shm",
]
