"""Shared helpers of the real-agent tests."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import numpy as np

import kvfabric

T = TypeVar("T")
_ids = itertools.count(1)


def unique(prefix: str) -> str:
    """An engine id unique in this test run (engine ids are fabric-wide)."""
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


def wait_for(pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition", step: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(step)


def _propagating(e: kvfabric.KvfabricError) -> bool:
    """Whether `e` says the destination's record has not fully propagated:
    NotFound (not there yet), or the agent's FailedPrecondition "has no pool
    registered" (the record published at Attach, before RegisterPool
    republished it with the pool, reached the source's agent first)."""
    if isinstance(e, kvfabric.NotFound):
        return True
    return isinstance(e, kvfabric.FailedPrecondition) and "no pool registered" in e.message


def until_found(fn: Callable[[], T], within: float = 5.0) -> T:
    """Retries `fn` while the destination engine's record is still
    propagating through etcd to the source's agent (see _propagating)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return fn()
        except kvfabric.KvfabricError as e:
            if not _propagating(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class Engine:
    """An attached engine of this test process: its client, session, shm
    pool and the pool as a layout-shaped numpy view."""

    client: kvfabric.Client
    session: kvfabric.Session
    pool: kvfabric.ShmPool
    layout: kvfabric.Layout
    view: Any

    @property
    def id(self) -> str:
        return self.session.engine_id

    def close(self) -> None:
        self.session.close()
        self.view = None
        self.pool.close()
        self.client.close()


def attach_engine(
    socket_path: str,
    prefix: str,
    role: str,
    layout: kvfabric.Layout,
    seed: Optional[int] = None,
    auto_reattach: bool = True,
    engine_id: Optional[str] = None,
) -> Engine:
    """Attaches an engine with a fresh shm pool (filled with non-zero random
    bytes from `seed`, else zeros) registered."""
    pool = kvfabric.ShmPool.for_layout(layout)
    view = pool.numpy(layout)
    if seed is not None:
        view[...] = np.random.default_rng(seed).integers(1, 256, view.shape, dtype=np.uint8)
    client = kvfabric.Client(socket_path, timeout=5.0)
    eid = engine_id or unique(prefix)
    session = client.attach(eid, f"uid-{eid}", role, layout, auto_reattach=auto_reattach)
    assert session.register_shm(pool) == layout.pool_bytes()
    return Engine(client, session, pool, layout, view)
