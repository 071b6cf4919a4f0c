"""Host-memory KV pools: named POSIX shared-memory objects.

The agent maps the object by its ``shm_open`` name (``"/name"``), so a pool
is shared between the engine and the agent without copies. Python's
``multiprocessing.shared_memory`` creates it; this module keeps Python's
resource tracker out of its life (it would unlink the object at interpreter
exit, and warn about a leak, while the agent may still map it) and unlinks
it itself in :meth:`ShmPool.close`.
"""

from __future__ import annotations

import os
import secrets
import sys
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, Optional

from .errors import InvalidArgument, KvfabricError

if TYPE_CHECKING:
    from .layout import Layout

_TRACK_PARAM = sys.version_info >= (3, 13)


def _shm_unlink(name: str) -> None:
    """``shm_unlink(name)`` (name with the leading "/"), not through the
    resource tracker."""
    import _posixshmem  # CPython's own binding, what SharedMemory uses

    _posixshmem.shm_unlink(name)


def unlink_shm(name: str) -> bool:
    """Removes the shm object ``name`` ("/..." or without the slash) if it
    exists, e.g. one left by an engine process that was killed. True when
    something was removed."""
    if not name.startswith("/"):
        name = "/" + name
    try:
        _shm_unlink(name)
        return True
    except FileNotFoundError:
        return False


class ShmPool:
    """A host KV pool: ``size`` bytes of a new POSIX shm object, zero-filled
    and mapped read-write in this process.

    ``name`` is the shm name with or without the leading "/" (default: a
    unique ``/kvfabric-<pid>-<random>``); :attr:`name` always has the "/"
    (what :meth:`kvfabric.Session.register_shm` sends). Close it (or use it
    as a context manager) when done: the object is unlinked, and the agent's
    own mapping keeps the memory alive until the agent lets go.
    """

    def __init__(self, name: Optional[str], size: int) -> None:
        if name is None:
            name = f"kvfabric-{os.getpid()}-{secrets.token_hex(4)}"
        bare = name[1:] if name.startswith("/") else name
        if not bare or "/" in bare or len(bare) > 250:
            raise InvalidArgument(
                f'shm name {name!r}: want "/name" (1-250 characters, no other "/")',
                call="ShmPool",
            )
        if size <= 0:
            raise InvalidArgument(f"shm size {size}: must be positive", call="ShmPool")
        kwargs: dict = {"track": False} if _TRACK_PARAM else {}
        try:
            shm = shared_memory.SharedMemory(name=bare, create=True, size=size, **kwargs)
        except FileExistsError:
            raise KvfabricError(f"shm object /{bare} exists already", call="ShmPool") from None
        if not _TRACK_PARAM:
            # Python < 3.13 registers every object it creates with the
            # resource tracker, which unlinks it at exit (and warns). We
            # unlink ourselves in close().
            try:
                from multiprocessing import resource_tracker

                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            except Exception:  # pragma: no cover - best effort
                pass
        self._shm: Optional[shared_memory.SharedMemory] = shm
        self._name = "/" + bare
        self._size = size
        self._unlinked = False

    @classmethod
    def for_layout(cls, layout: "Layout", name: Optional[str] = None) -> "ShmPool":
        """A pool sized for ``layout`` (``layout.pool_bytes()``)."""
        return cls(name, layout.pool_bytes())

    @property
    def name(self) -> str:
        """The shm_open name, with the leading "/"."""
        return self._name

    @property
    def size(self) -> int:
        """Length in bytes (what RegisterPool sends as ``len``)."""
        return self._size

    def __len__(self) -> int:
        return self._size

    @property
    def closed(self) -> bool:
        return self._shm is None

    @property
    def buf(self) -> memoryview:
        """The pool's bytes (writable, exactly ``size`` long)."""
        if self._shm is None:
            raise KvfabricError(f"shm pool {self._name} is closed", call="ShmPool")
        buf = self._shm.buf
        assert buf is not None
        return buf[: self._size]

    def numpy(self, layout: "Optional[Layout]" = None, *, raw: bool = True) -> Any:
        """A numpy view of the pool (no copy): flat uint8, or shaped by
        ``layout`` (see :meth:`kvfabric.Layout.numpy_view`). Requires numpy.
        Drop the views before :meth:`close`."""
        import numpy as np

        if layout is not None:
            return layout.numpy_view(self.buf, raw=raw)
        return np.frombuffer(self.buf, dtype=np.uint8)

    def torch(self) -> Any:
        """A CPU ``torch.uint8`` tensor over the pool (no copy; needs torch,
        imported only here)."""
        import torch

        return torch.frombuffer(self.buf, dtype=torch.uint8)

    def unlink(self) -> None:
        """Removes the name (the mapping stays valid until close)."""
        if not self._unlinked:
            self._unlinked = True
            try:
                _shm_unlink(self._name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlinks the object and unmaps it from this process. Raises
        BufferError while views of :attr:`buf` (numpy arrays, memoryviews)
        are still alive; the name is gone by then anyway."""
        self.unlink()
        shm = self._shm
        if shm is None:
            return
        try:
            shm.close()
        except BufferError as e:
            raise BufferError(
                f"shm pool {self._name}: views of its buffer are still alive "
                f"(drop numpy arrays / memoryviews before close): {e}"
            ) from None
        self._shm = None

    def __enter__(self) -> "ShmPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.unlink()
            if self._shm is not None:
                self._shm.close()
                self._shm = None
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._shm is None else "open"
        return f"ShmPool({self._name!r}, size={self._size}, {state})"
