"""GPU KV pools from torch tensors, as CUDA IPC handles.

torch is imported lazily, only by these functions: the package itself (and
CI) runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgument

#: sizeof(cudaIpcMemHandle_t).
CUDA_IPC_HANDLE_SIZE = 64


@dataclass(frozen=True)
class CudaIpcPool:
    """A KV pool in GPU memory: the 64-byte ``cudaIpcMemHandle_t`` of the
    cudaMalloc'd allocation holding it, the pool's byte offset inside that
    allocation, its length, and the CUDA device ordinal."""

    handle: bytes
    offset: int
    len: int
    device: int


def _raw_handle(handle: bytes) -> bytes:
    """The cudaIpcMemHandle_t inside torch's shareable handle. torch < 2.2
    hands out the raw 64 bytes; later versions prefix a version byte and a
    type byte ('c' = plain cudaMalloc block, 'e' = expandable segment)."""
    if len(handle) == CUDA_IPC_HANDLE_SIZE:
        return bytes(handle)
    if len(handle) == CUDA_IPC_HANDLE_SIZE + 2 and handle[1:2] == b"c":
        return bytes(handle[2:])
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise InvalidArgument(
            "the tensor lives in an expandable segment "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which has no CUDA IPC "
            "handle: allocate the KV pool with expandable segments off",
            call="torch_pool_from_tensor",
        )
    raise InvalidArgument(
        f"unrecognised torch CUDA IPC handle ({len(handle)} bytes)",
        call="torch_pool_from_tensor",
    )


def torch_pool_from_tensor(tensor: Any) -> CudaIpcPool:
    """The CUDA IPC description of a contiguous CUDA tensor that holds an
    engine's whole KV pool (laid out as its :class:`kvfabric.Layout` says).
    Keep the tensor alive while the session uses it.

    Uses torch's own sharing (``untyped_storage()._share_cuda_()``): the
    handle is the caching allocator's segment, the offset the tensor's place
    in it. The agent does not take part in torch's IPC reference counting,
    so torch may warn at exit that the "producer process has been
    terminated before all shared CUDA tensors released": harmless here."""
    import torch  # noqa: F401  (lazy: only engines with torch get here)

    if not getattr(tensor, "is_cuda", False):
        raise InvalidArgument(
            "the tensor is not on a CUDA device: use a kvfabric.ShmPool (pool.torch()) for host memory",
            call="torch_pool_from_tensor",
        )
    if not tensor.is_contiguous():
        raise InvalidArgument("the tensor is not contiguous", call="torch_pool_from_tensor")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    # (device, handle, storage_size_bytes, storage_offset_bytes, ref counter
    # handle, ref counter offset, event handle, event sync required)
    device, handle, _size, storage_offset_bytes = shared[0], shared[1], shared[2], shared[3]
    offset = int(storage_offset_bytes) + tensor.storage_offset() * tensor.element_size()
    length = tensor.numel() * tensor.element_size()
    return CudaIpcPool(
        handle=_raw_handle(handle), offset=offset, len=length, device=int(device)
    )


def gpu_uuid(device: int) -> str:
    """The UUID of CUDA device ``device`` of this process, as torch reports
    it (``get_device_properties(device).uuid``), in the agent's canonical
    text. Raises InvalidArgument without torch or CUDA, or for a device
    this process does not have."""
    try:
        import torch
    except (ImportError, OSError) as e:
        raise InvalidArgument(f"gpu_uuid needs torch (pip install torch): {e}", call="gpu_uuid") from None
    if not torch.cuda.is_available() or not 0 <= device < torch.cuda.device_count():
        raise InvalidArgument(
            f"device {device}: this process has {torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices",
            call="gpu_uuid",
        )
    from .layout import canonical_gpu_uuid

    return canonical_gpu_uuid(str(torch.cuda.get_device_properties(device).uuid))
