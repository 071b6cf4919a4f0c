"""CUDA IPC pools from torch tensors (kvfabric.torch_pool_from_tensor): the
handle, offset and length must let another process (as the agent does) open
the allocation and find the tensor's bytes. Needs torch with a CUDA GPU and
cupy (for the importing side); skips otherwise (CI has no torch)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

from kvfabric.torch_pool import torch_pool_from_tensor  # noqa: E402

IMPORTER = r"""
import hashlib, sys
import cupy, numpy as np
handle, offset, length = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
base = cupy.cuda.runtime.ipcOpenMemHandle(handle)
host = np.empty(length, dtype=np.uint8)
cupy.cuda.runtime.memcpy(host.ctypes.data, base + offset, length, cupy.cuda.runtime.memcpyDeviceToHost)
print(hashlib.sha256(host.tobytes()).hexdigest())
cupy.cuda.runtime.ipcCloseMemHandle(base)
"""


def opened_elsewhere(t) -> str:
    p = torch_pool_from_tensor(t)
    assert len(p.handle) == 64
    assert p.len == t.numel() * t.element_size()
    assert p.device == t.device.index
    r = subprocess.run(
        [sys.executable, "-c", IMPORTER, p.handle.hex(), str(p.offset), str(p.len)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def digest(t) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def test_whole_allocation_and_a_slice():
    n = 8 << 20
    pool = (torch.arange(n, dtype=torch.int64, device="cuda") * 2654435761 >> 13).remainder(251).to(torch.uint8)
    torch.cuda.synchronize()
    assert opened_elsewhere(pool) == digest(pool)
    view = pool[12345:]  # a storage offset inside the allocation
    assert opened_elsewhere(view) == digest(view)


def test_small_tensor_inside_a_shared_segment():
    # Small tensors share the caching allocator's 2 MiB segments: the
    # handle is the segment's, the offset the block's place in it.
    a = torch.full((4096,), 7, dtype=torch.uint8, device="cuda")
    b = torch.arange(4096, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    pa, pb = torch_pool_from_tensor(a), torch_pool_from_tensor(b)
    assert pa.offset != pb.offset or pa.handle != pb.handle
    assert opened_elsewhere(b) == digest(b)
    assert opened_elsewhere(a) == digest(a)


def test_refuses_host_and_non_contiguous_tensors():
    import kvfabric

    with pytest.raises(kvfabric.InvalidArgument):
        torch_pool_from_tensor(torch.zeros(16))
    with pytest.raises(kvfabric.InvalidArgument):
        torch_pool_from_tensor(torch.zeros(16, 16, device="cuda").t())
