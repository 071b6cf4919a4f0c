"""Typed errors of the engine API client.

Every failed call raises a :class:`KvfabricError`; the agent's gRPC status
code picks the subclass. A transfer or arrival that *resolves* unsuccessfully
(outcome ``failure``, ``timeout`` or ``cancelled``) is not an error: it comes
back as a result object with ``ok == False``.
"""

from __future__ import annotations

from typing import Optional

import grpc


class KvfabricError(Exception):
    """Base class. ``call`` is the RPC ("Attach", "Transfer", ...) or the
    local operation, ``code`` the :class:`grpc.StatusCode` (None for errors
    raised locally) and ``message`` the agent's (or the client's) text."""

    def __init__(
        self,
        message: str,
        *,
        call: str = "",
        code: Optional[grpc.StatusCode] = None,
    ) -> None:
        self.message = message
        self.call = call
        self.code = code
        prefix = call + ": " if call else ""
        if code is not None:
            prefix += code.name + ": "
        super().__init__(prefix + message)


class InvalidArgument(KvfabricError, ValueError):
    """A bad request: block id out of range, lists of different lengths, a
    layout that is invalid on its own, a pool that cannot be mapped."""


class NotFound(KvfabricError, LookupError):
    """Unknown session (detached, or the engine's connection died), unknown
    destination engine (not attached anywhere, or not yet propagated to this
    agent), unknown request."""


class FailedPrecondition(KvfabricError):
    """The request is well-formed but the state refuses it: layouts that
    cannot be mapped onto each other (the message names both), a pool
    registered twice, no pool registered."""


class AlreadyExists(KvfabricError):
    """The engine id is attached already (the agent may not have noticed the
    previous session's end yet), or the request id is in flight already."""


class Timeout(KvfabricError, TimeoutError):
    """The call did not complete within its deadline."""


class Unavailable(KvfabricError, ConnectionError):
    """The agent cannot be reached (socket absent, agent restarting) or the
    connection dropped during the call."""


class Unimplemented(KvfabricError):
    """The agent does not implement the call or variant (for example CUDA IPC
    pools on an agent built without GPU support)."""


class ProtocolError(KvfabricError):
    """The agent broke the protocol (an Attach stream that did not begin
    with ``attached``)."""


class SessionClosed(NotFound):
    """The session was detached or closed by this client."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}


def from_rpc_error(err: grpc.RpcError, call: str) -> KvfabricError:
    """The typed error for a failed gRPC call."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else None
    message = details or (code.name.lower() if code is not None else str(err))
    cls = _BY_CODE.get(code, KvfabricError)
    return cls(message, call=call, code=code)
