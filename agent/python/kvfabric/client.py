"""The engine API client: :class:`Client` (one per process and agent socket)
and :class:`Session` (one attached engine).

Every unary call carries a gRPC deadline: the client's ``timeout`` (5 s by
default), plus the request's own bound for ``Transfer`` and
``AwaitArrival``. The Attach stream has no deadline (it *is* the session),
but its first event must arrive within ``timeout``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

import grpc

from ._proto import engine_pb2 as pb
from ._proto import engine_pb2_grpc as pb_grpc
from .errors import (
    AlreadyExists,
    InvalidArgument,
    KvfabricError,
    ProtocolError,
    SessionClosed,
    Timeout,
    Unavailable,
    from_rpc_error,
)
from .layout import Layout, canonical_gpu_uuid
from .shm import ShmPool
from .torch_pool import CudaIpcPool

_log = logging.getLogger("kvfabric")

#: Default bound on one unary call, seconds.
DEFAULT_TIMEOUT = 5.0

#: Where the chart mounts the agents' sockets (agent.socket.hostPath).
DEFAULT_SOCKET_DIR = "/run/kvfabric"


def engine_socket(gpu_uuid: str = "", directory: Optional[str] = None, timeout: float = 0.0) -> str:
    """The agent socket an engine connects to.

    ``$KVFABRIC_ENGINE_SOCKET`` when set (a ``{gpu_uuid}`` in it becomes
    ``gpu_uuid``). Otherwise, in ``directory`` (default
    ``$KVFABRIC_SOCKET_DIR`` or /run/kvfabric): the socket named after the
    engine's GPU, ``<uuid>.sock`` — served where a node runs one agent per
    GPU (the chart's ``agent.gpu.count`` > 1) — when ``gpu_uuid`` is given
    and that socket exists, else ``engine.sock`` where it exists. With a
    ``gpu_uuid`` and neither socket there yet (the agent not up), waits up
    to ``timeout`` seconds for one, then raises Unavailable naming both:
    which one will be served is the node's choice, not a guess. Without a
    ``gpu_uuid``: ``engine.sock``. A GPU engine that reaches another GPU's
    agent is refused at attach with both UUIDs named. ``gpu_uuid``: any
    form :func:`canonical_gpu_uuid` takes (``kvfabric.gpu_uuid(d)`` with
    torch); InvalidArgument for another."""
    uuid = canonical_gpu_uuid(gpu_uuid) if gpu_uuid else ""
    explicit = os.environ.get("KVFABRIC_ENGINE_SOCKET", "")
    if explicit:
        if "{gpu_uuid}" in explicit:
            if not uuid:
                raise InvalidArgument(
                    f"KVFABRIC_ENGINE_SOCKET {explicit!r} names {{gpu_uuid}}: give the engine's GPU UUID",
                    call="engine_socket",
                )
            return explicit.replace("{gpu_uuid}", uuid)
        return explicit
    d = directory or os.environ.get("KVFABRIC_SOCKET_DIR", "") or DEFAULT_SOCKET_DIR
    node = os.path.join(d, "engine.sock")
    if not uuid:
        return node
    per_gpu = os.path.join(d, uuid + ".sock")
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        for p in (per_gpu, node):
            if os.path.exists(p):
                return p
        if time.monotonic() >= deadline:
            raise Unavailable(
                f"no agent socket for GPU {uuid} in {d} within {timeout:.1f} s "
                f"(neither {uuid}.sock, one agent per GPU, nor engine.sock, one agent per node)",
                call="engine_socket",
            )
        time.sleep(0.05)


#: Extra bound for Transfer / AwaitArrival when they leave the timeout to the
#: agent (its requestTimeoutMs, 30 s by default), seconds.
AGENT_DEFAULT_WAIT = 60.0

_ROLES = {
    "prefill": pb.ROLE_PREFILL,
    "decode": pb.ROLE_DECODE,
    "both": pb.ROLE_BOTH,
}
_PATHS = {
    "auto": pb.PATH_AUTO,
    "bounce": pb.PATH_BOUNCE,
    "standard": pb.PATH_STANDARD,
}
_OUTCOMES = {
    pb.OUTCOME_UNSPECIFIED: "unspecified",
    pb.OUTCOME_SUCCESS: "success",
    pb.OUTCOME_FAILURE: "failure",
    pb.OUTCOME_TIMEOUT: "timeout",
    pb.OUTCOME_CANCELLED: "cancelled",
}

#: Pause before re-attaching after the agent said `closing`, seconds.
CLOSING_BACKOFF = 0.5

Role = Union[str, int]
Extents = Iterable[Tuple[int, int, int]]


def _role(role: Role) -> int:
    if isinstance(role, str):
        try:
            return _ROLES[role.lower()]
        except KeyError:
            raise ValueError(f"role {role!r}: expected prefill, decode or both") from None
    return int(role)


def _path(path: Union[str, int]) -> int:
    if isinstance(path, str):
        try:
            return _PATHS[path.lower()]
        except KeyError:
            raise ValueError(f"path {path!r}: expected auto, bounce or standard") from None
    return int(path)


# -- results ---------------------------------------------------------------


@dataclass(frozen=True)
class TransferResult:
    """How a Transfer resolved. ``outcome`` is "success", "failure",
    "timeout" or "cancelled"; ``reason`` says why it did not succeed;
    ``path`` is "bounce", "standard" or "direct" (both engines on one agent); times in microseconds."""

    request_id: int
    outcome: str
    reason: str
    path: str
    bytes: int
    descriptors: int
    submit_us: int
    transfer_us: int

    @property
    def ok(self) -> bool:
        return self.outcome == "success"

    @classmethod
    def _from(cls, request_id: int, r: pb.TransferResponse) -> "TransferResult":
        return cls(
            request_id=request_id,
            outcome=_OUTCOMES.get(r.outcome, str(r.outcome)),
            reason=r.reason,
            path=r.path,
            bytes=r.bytes,
            descriptors=r.descriptors,
            submit_us=r.submit_us,
            transfer_us=r.transfer_us,
        )


@dataclass(frozen=True)
class ArrivalResult:
    """How an AwaitArrival resolved: ``outcome`` as for transfers, the
    source engine and the bytes that landed."""

    request_id: int
    outcome: str
    reason: str
    src_engine: str
    bytes: int

    @property
    def ok(self) -> bool:
        return self.outcome == "success"

    @classmethod
    def _from(cls, request_id: int, r: pb.AwaitArrivalResponse) -> "ArrivalResult":
        return cls(
            request_id=request_id,
            outcome=_OUTCOMES.get(r.outcome, str(r.outcome)),
            reason=r.reason,
            src_engine=r.src_engine,
            bytes=r.bytes,
        )


@dataclass(frozen=True)
class InFlight:
    request_id: int
    dst_engine: str
    path: str
    bytes: int
    age_us: int


@dataclass(frozen=True)
class SessionStatus:
    """A session's in-flight requests and counters (StatusResponse)."""

    engine_id: str
    in_flight: List[InFlight] = field(default_factory=list)
    transfers_succeeded: int = 0
    transfers_failed: int = 0
    bytes_sent: int = 0
    arrivals: int = 0
    pool_len: int = 0

    @classmethod
    def _from(cls, r: pb.StatusResponse) -> "SessionStatus":
        return cls(
            engine_id=r.engine_id,
            in_flight=[
                InFlight(f.request_id, f.dst_engine, f.path, f.bytes, f.age_us)
                for f in r.in_flight
            ],
            transfers_succeeded=r.transfers_succeeded,
            transfers_failed=r.transfers_failed,
            bytes_sent=r.bytes_sent,
            arrivals=r.arrivals,
            pool_len=r.pool_len,
        )


# -- futures ---------------------------------------------------------------


def _chain(
    call: Any, rpc: str, convert: Callable[[Any], Any]
) -> "Future[Any]":
    """A concurrent.futures.Future that resolves with ``convert(response)``
    of a grpc future ``call``, or a typed error. Cancelling it cancels the
    RPC (not the agent-side request: use Session.cancel for that)."""
    fut: "Future[Any]" = Future()

    def done(c: Any) -> None:
        if fut.cancelled():
            return
        try:
            value = convert(c.result())
        except grpc.FutureCancelledError:
            fut.cancel()
            return
        except grpc.RpcError as e:
            _settle(fut, exc=from_rpc_error(e, rpc))
            return
        except BaseException as e:  # pragma: no cover - conversion bug
            _settle(fut, exc=e)
            return
        _settle(fut, value=value)

    def on_cancel(f: "Future[Any]") -> None:
        if f.cancelled():
            call.cancel()

    fut.add_done_callback(on_cancel)
    call.add_done_callback(done)
    return fut


def _settle(fut: "Future[Any]", value: Any = None, exc: Optional[BaseException] = None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except Exception:  # InvalidStateError: cancelled meanwhile
        pass


# -- the client ------------------------------------------------------------


class Client:
    """A connection to the kvfabric agent's engine API on the Unix socket
    ``socket_path``. The gRPC channel connects lazily and reconnects by
    itself (quickly: a local socket, backoff capped at 1 s). ``timeout``
    bounds every unary call, in seconds. Thread-safe; use one per process."""

    def __init__(
        self,
        socket_path: Union[str, "os.PathLike[str]"],
        timeout: float = DEFAULT_TIMEOUT,
        *,
        options: Sequence[Tuple[str, Any]] = (),
    ) -> None:
        self.socket_path = os.path.abspath(os.fspath(socket_path))
        self.timeout = float(timeout)
        opts = {
            # gRPC core would send the socket path as :authority, which
            # HTTP/2 servers that check the header (hyper/tonic: the agent)
            # reset with PROTOCOL_ERROR.
            "grpc.default_authority": "localhost",
            "grpc.keepalive_time_ms": 10_000,
            "grpc.keepalive_timeout_ms": 5_000,
            "grpc.initial_reconnect_backoff_ms": 100,
            "grpc.min_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 1_000,
            "grpc.max_receive_message_length": 64 << 20,
            "grpc.max_send_message_length": 64 << 20,
        }
        opts.update(dict(options))
        self._channel = grpc.insecure_channel("unix://" + self.socket_path, options=list(opts.items()))
        self._stub = pb_grpc.EngineApiStub(self._channel)
        self._closed = False
        self._cores: "weakref.WeakSet[_SessionCore]" = weakref.WeakSet()

    # The raw calls, bounded. `extra` lengthens the deadline.
    def _unary(self, rpc: str, request: Any, extra: float = 0.0) -> Any:
        method = getattr(self._stub, rpc)
        try:
            return method(request, timeout=self.timeout + extra)
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None

    def _unary_future(self, rpc: str, request: Any, extra: float, convert: Callable[[Any], Any]) -> "Future[Any]":
        method = getattr(self._stub, rpc)
        return _chain(method.future(request, timeout=self.timeout + extra), rpc, convert)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Blocks until the socket accepts a connection (Timeout if not
        within ``timeout``, default the client's)."""
        t = self.timeout if timeout is None else timeout
        try:
            grpc.channel_ready_future(self._channel).result(timeout=t)
        except grpc.FutureTimeoutError:
            raise Timeout(f"no connection to {self.socket_path} within {t:.1f} s", call="connect") from None

    def attach(
        self,
        engine_id: str,
        pod_uid: str,
        role: Role,
        layout: Layout,
        *,
        auto_reattach: bool = True,
    ) -> "Session":
        """Attaches engine ``engine_id`` (of pod ``pod_uid``, may be empty;
        ``role`` "prefill", "decode" or "both"; its KV ``layout``) and
        returns its :class:`Session`, whose Attach stream a daemon thread
        keeps open.

        With ``auto_reattach`` (the default) the session re-attaches by
        itself when the stream ends without :meth:`Session.detach` /
        :meth:`Session.close` (agent restart, dropped connection), and
        registers its pool again; :attr:`Session.id` then changes.

        Raises InvalidArgument (bad layout or id), AlreadyExists (engine id
        attached already), Unavailable (no agent), Timeout."""
        if self._closed:
            raise KvfabricError("client is closed", call="Attach")
        if isinstance(layout, pb.KvLayout):
            layout = Layout.from_proto(layout)
        if layout.device >= 0 and not layout.device_uuid:
            # The agent matches GPU engines by UUID (ordinals are per
            # process); torch knows it where it is installed.
            try:
                from .torch_pool import gpu_uuid

                layout = layout.with_(device_uuid=gpu_uuid(layout.device))
            except (KvfabricError, RuntimeError, AttributeError) as e:
                # No torch, no CUDA, a torch without .uuid: the agent
                # matches by ordinal (or refuses, with requireDeviceUuid).
                _log.warning(
                    "attach %s: layout.device %d without a GPU UUID (%s); pass Layout(device_uuid=...) "
                    "where ordinals differ between the engine and the agent",
                    engine_id,
                    layout.device,
                    e,
                )
        core = _SessionCore(
            self,
            pb.AttachRequest(
                engine_id=engine_id,
                pod_uid=pod_uid,
                role=_role(role),
                layout=layout.to_proto(),
            ),
            layout,
            auto_reattach,
        )
        core.attach_first()
        self._cores.add(core)
        return Session(core)

    def status(self, session_id: str) -> SessionStatus:
        """Status of any session by id (NotFound once it is gone)."""
        return SessionStatus._from(self._unary("Status", pb.StatusRequest(session=session_id)))

    def close(self) -> None:
        """Closes the sessions (best-effort Detach) and the channel."""
        self._closed = True
        for core in list(self._cores):
            core.close(detach=True)
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.socket_path!r}, timeout={self.timeout})"


# -- sessions --------------------------------------------------------------


class _Stream:
    """One Attach stream and the daemon thread that consumes it."""

    def __init__(self, core: "_SessionCore", call: Any) -> None:
        self.core = core
        self.call = call
        self.first: "Future[pb.Attached]" = Future()
        self.ended = threading.Event()
        self.end_reason = ""
        self.closing_reason = ""
        self.last_event = time.monotonic()
        self.thread = threading.Thread(
            target=self._run, name=f"kvfabric-session-{core.engine_id}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            for ev in self.call:
                self.last_event = time.monotonic()
                kind = ev.WhichOneof("event")
                if not self.first.done():
                    if kind == "attached":
                        self.first.set_result(ev.attached)
                        continue
                    self.first.set_exception(
                        ProtocolError(f"the Attach stream began with {kind!r}, not 'attached'", call="Attach")
                    )
                    self.call.cancel()
                    break
                if kind == "closing":
                    self.closing_reason = ev.closing.reason
                    with self.core.cv:
                        self.core.last_closing = ev.closing.reason
            self.end_reason = self.closing_reason or "the agent ended the Attach stream"
        except grpc.RpcError as e:
            err = from_rpc_error(e, "Attach")
            self.end_reason = str(err)
            if not self.first.done():
                self.first.set_exception(err)
        except BaseException as e:  # pragma: no cover - defensive
            self.end_reason = f"stream reader failed: {e!r}"
        finally:
            if not self.first.done():
                self.first.set_exception(
                    ProtocolError("the Attach stream ended before 'attached'", call="Attach")
                )
            self.ended.set()
            self.core._stream_ended(self)

    def cancel(self) -> None:
        self.call.cancel()


class _SessionCore:
    """The state a Session shares with its stream threads (they hold this,
    not the Session, so a dropped Session is collected and detaches)."""

    def __init__(self, client: Client, req: pb.AttachRequest, layout: Layout, auto_reattach: bool) -> None:
        self.client = client
        self.req = req
        self.layout = layout
        self.engine_id = req.engine_id
        self.auto_reattach = auto_reattach
        self.cv = threading.Condition()
        self.attach_lock = threading.Lock()
        self.stream: Optional[_Stream] = None
        self.attached: Optional[pb.Attached] = None
        self.generation = 0
        self.closed = False
        self.memory: Optional[Tuple[str, Any]] = None  # RegisterPool oneof, for re-attach
        self.last_error: Optional[BaseException] = None
        self.last_closing = ""
        self.reattaching = False

    # Opening -------------------------------------------------------------

    def _open_stream(self) -> Tuple[_Stream, pb.Attached]:
        """Starts an Attach stream and waits (bounded) for `attached`."""
        try:
            call = self.client._stub.Attach(self.req)  # no deadline: the stream is the session
        except grpc.RpcError as e:  # pragma: no cover - raised lazily in practice
            raise from_rpc_error(e, "Attach") from None
        except ValueError as e:  # the channel was closed
            raise SessionClosed(f"the client is closed ({e})", call="Attach") from None
        st = _Stream(self, call)
        st.start()
        try:
            attached = st.first.result(timeout=self.client.timeout)
        except FutureTimeoutError:
            st.cancel()
            raise Timeout(
                f"no 'attached' event within {self.client.timeout:.1f} s", call="Attach"
            ) from None
        except BaseException:
            st.cancel()
            raise
        return st, attached

    def _register(self, session_id: str, kind: str, msg: Any) -> int:
        req = pb.RegisterPoolRequest(session=session_id, **{kind: msg})
        return int(self.client._unary("RegisterPool", req).len)

    def _attach_once(self) -> None:
        """One attach (+ re-registration of the pool); swaps the stream in."""
        st, attached = self._open_stream()
        with self.cv:
            memory = self.memory
        if memory is not None:
            try:
                self._register(attached.session, *memory)
            except BaseException:
                st.cancel()  # never leave a session without its pool
                raise
        with self.cv:
            if self.closed:
                st.cancel()
                raise SessionClosed("the session was closed", call="Attach")
            old = self.stream
            self.stream = st
            self.attached = attached
            self.generation += 1
            self.last_error = None
            self.cv.notify_all()
            # It may have ended before it became current (its thread then
            # ignored it): hand it to the re-attach logic now.
            kick = st.ended.is_set() and not self.reattaching
        if old is not None and not old.ended.is_set():
            old.cancel()
        if kick:
            threading.Thread(target=self._stream_ended, args=(st,), daemon=True).start()

    def attach_first(self) -> None:
        with self.attach_lock:
            self._attach_once()

    def reattach(self, deadline: Optional[float]) -> None:
        """Attaches again unless a live stream exists, retrying (backoff
        50 ms .. 1 s) until success, the deadline, or close()."""
        delay = 0.05
        while True:
            with self.attach_lock:
                with self.cv:
                    if self.closed:
                        raise SessionClosed("the session was closed", call="Attach")
                    if self.stream is not None and not self.stream.ended.is_set():
                        return
                try:
                    self._attach_once()
                    return
                except KvfabricError as e:
                    if isinstance(e, SessionClosed):
                        raise
                    with self.cv:
                        self.last_error = e
                    last: KvfabricError = e
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise last
            wait = delay if deadline is None else min(delay, max(0.0, deadline - now))
            with self.cv:
                if self.closed:
                    raise SessionClosed("the session was closed", call="Attach")
                self.cv.wait(wait)
            delay = min(delay * 2, 1.0)

    def _stream_ended(self, st: _Stream) -> None:
        with self.cv:
            current = st is self.stream
            self.cv.notify_all()
            if not current or self.closed or not self.auto_reattach or self.reattaching:
                return
            self.reattaching = True
        # The current stream of a live session ended: the agent restarted,
        # shut down, or dropped us. Re-attach on this (daemon) thread, and
        # again if the new stream ends while we are at it. After a `closing`
        # (the agent is shutting down) give it a moment to go away first.
        if st.closing_reason:
            with self.cv:
                self.cv.wait_for(lambda: self.closed, timeout=CLOSING_BACKOFF)
        while True:
            try:
                self.reattach(deadline=None)
            except KvfabricError:
                pass
            with self.cv:
                again = not self.closed and self.stream is not None and self.stream.ended.is_set()
                if not again:
                    self.reattaching = False
                    return

    # State ---------------------------------------------------------------

    def is_open(self) -> bool:
        with self.cv:
            return not self.closed and self.stream is not None and not self.stream.ended.is_set()

    def session_id(self) -> str:
        with self.cv:
            if self.attached is None:
                raise SessionClosed("not attached", call="session")
            return self.attached.session

    def close(self, detach: bool) -> Optional[BaseException]:
        """Marks the session closed, sends Detach (when asked) and ends the
        stream. Returns the Detach error, if any."""
        with self.cv:
            if self.closed:
                return None
            self.closed = True
            st = self.stream
            sid = self.attached.session if self.attached is not None else None
            self.cv.notify_all()
        err: Optional[BaseException] = None
        if detach and sid is not None and st is not None and not st.ended.is_set():
            try:
                self.client._unary("Detach", pb.DetachRequest(session=sid))
            except KvfabricError as e:
                err = e
        if st is not None:
            st.cancel()
        return err


def _finalize(core: _SessionCore) -> None:
    # The Session was garbage-collected: end its stream (the agent treats
    # that as a detach), like dropping the Rust client's Session.
    core.close(detach=False)


class Session:
    """One attached engine. Its Attach stream stays open on a daemon thread
    until :meth:`detach`, :meth:`close`, leaving a ``with`` block, or the
    Session being garbage-collected; the process dying ends it too (the
    agent notices within a second and fails the engine's requests).

    Request ids are unique per source engine among its live requests."""

    def __init__(self, core: _SessionCore) -> None:
        self._core = core
        self._finalizer = weakref.finalize(self, _finalize, core)

    # -- identity ----------------------------------------------------------

    @property
    def id(self) -> str:
        """The session id the agent gave (changes on re-attach)."""
        return self._core.session_id()

    @property
    def agent(self) -> str:
        """The agent's NIXL name (incarnation included)."""
        a = self._core.attached
        return a.agent if a is not None else ""

    @property
    def layout_fingerprint(self) -> str:
        a = self._core.attached
        return a.layout_fingerprint if a is not None else ""

    @property
    def incarnation(self) -> int:
        """This attach's incarnation (non-zero; changes on re-attach). A
        decode engine passes it, with the block ids it allocated, to the
        engine that writes them (``dst_incarnation``), so a hand-off into
        blocks of an allocation that ended with a re-attach is refused."""
        a = self._core.attached
        return a.incarnation if a is not None else 0

    @property
    def engine_id(self) -> str:
        return self._core.engine_id

    @property
    def layout(self) -> Layout:
        return self._core.layout

    @property
    def client(self) -> Client:
        return self._core.client

    @property
    def is_open(self) -> bool:
        """Whether the Attach stream is open now (False once the agent
        ended it, until a re-attach succeeds; False after close)."""
        return self._core.is_open()

    @property
    def closed(self) -> bool:
        """Whether detach()/close() was called."""
        return self._core.closed

    @property
    def generation(self) -> int:
        """How many times this session attached (1, +1 per re-attach)."""
        return self._core.generation

    @property
    def last_error(self) -> Optional[BaseException]:
        """The last re-attach failure, if the session is not open."""
        return self._core.last_error

    @property
    def closing_reason(self) -> str:
        """The reason of the last `closing` event the agent sent this
        session (e.g. on shutdown), "" if none ever came."""
        with self._core.cv:
            return self._core.last_closing

    def wait_open(self, timeout: Optional[float] = None) -> bool:
        """Waits until the session is attached (e.g. re-attached after an
        agent restart); False on timeout or when closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._core.cv:
            while True:
                if self._core.closed:
                    return False
                st = self._core.stream
                if st is not None and not st.ended.is_set():
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._core.cv.wait(left if left is not None else 1.0)

    def reattach(self, timeout: Optional[float] = None) -> str:
        """Attaches again now if the stream is not open (retrying while the
        agent restarts, up to ``timeout`` seconds, default the client's
        timeout) and registers the pool again. Returns the session id.
        A no-op when the session is open."""
        t = self._core.client.timeout if timeout is None else timeout
        self._core.reattach(deadline=time.monotonic() + t)
        return self.id

    # -- pools -------------------------------------------------------------

    def _register(self, kind: str, msg: Any) -> int:
        with self._core.attach_lock:
            n = self._core._register(self.id, kind, msg)
            with self._core.cv:
                self._core.memory = (kind, msg)
        return n

    def register_shm(self, pool: Union[ShmPool, str], size: Optional[int] = None) -> int:
        """Registers a host pool (a :class:`ShmPool`, or a shm name and its
        size) as this engine's KV pool; returns the length the agent
        registered. InvalidArgument when it is smaller than the layout or
        cannot be mapped; FailedPrecondition when a pool is registered
        already."""
        if isinstance(pool, ShmPool):
            name, length = pool.name, pool.size
        else:
            if size is None:
                raise ValueError("register_shm(name, size): size is required with a name")
            name = pool if pool.startswith("/") else "/" + pool
            length = size
        return self._register("shm", pb.ShmPool(name=name, len=length))

    def register_cuda_ipc(self, handle: bytes, offset: int, length: int) -> int:
        """Registers GPU memory: the 64-byte cudaIpcMemHandle_t of a
        cudaMalloc'd allocation on ``layout.device``, ``length`` bytes from
        ``offset`` in it. Unimplemented on an agent built without GPU
        support."""
        return self._register(
            "cuda_ipc", pb.CudaIpcPool(handle=bytes(handle), offset=offset, len=length)
        )

    def register_tensor(self, tensor: Any) -> int:
        """Registers a contiguous CUDA torch tensor holding the whole pool
        (CUDA IPC; torch is imported only here). Keep the tensor alive."""
        from .torch_pool import torch_pool_from_tensor

        p = torch_pool_from_tensor(tensor)
        return self.register_pool(p)

    def register_pool(self, pool: Union[ShmPool, CudaIpcPool]) -> int:
        """Registers a :class:`ShmPool` or a :class:`CudaIpcPool`."""
        if isinstance(pool, ShmPool):
            return self.register_shm(pool)
        if isinstance(pool, CudaIpcPool):
            if pool.device != self.layout.device:
                raise ValueError(
                    f"the pool is on CUDA device {pool.device}, the layout says device {self.layout.device}"
                )
            return self.register_cuda_ipc(pool.handle, pool.offset, pool.len)
        raise TypeError(f"not a pool: {pool!r}")

    # -- transfers ---------------------------------------------------------

    def _transfer_request(
        self,
        request_id: int,
        dst_engine: str,
        src_blocks: Optional[Sequence[int]],
        dst_blocks: Optional[Sequence[int]],
        extents: Optional[Extents],
        path: Union[str, int],
        timeout_ms: int,
        traceparent: str,
        dst_incarnation: int = 0,
    ) -> Tuple[pb.TransferRequest, float]:
        req = pb.TransferRequest(
            session=self.id,
            request_id=request_id,
            dst_engine=dst_engine,
            path=_path(path),
            timeout_ms=int(timeout_ms),
            traceparent=traceparent,
            dst_incarnation=int(dst_incarnation),
        )
        if extents is not None:
            if src_blocks or dst_blocks:
                raise ValueError("give blocks or extents, not both")
            req.extents.CopyFrom(
                pb.ExtentList(
                    extents=[pb.Extent(src_offset=s, dst_offset=d, len=n) for (s, d, n) in extents]
                )
            )
        else:
            req.src_blocks.extend(int(b) for b in (src_blocks or ()))
            req.dst_blocks.extend(int(b) for b in (dst_blocks or ()))
        extra = timeout_ms / 1000.0 if timeout_ms else AGENT_DEFAULT_WAIT
        return req, extra

    def transfer_blocks(
        self,
        request_id: int,
        dst_engine: str,
        src_blocks: Optional[Sequence[int]] = None,
        dst_blocks: Optional[Sequence[int]] = None,
        *,
        extents: Optional[Extents] = None,
        path: Union[str, int] = "auto",
        timeout_ms: int = 0,
        traceparent: str = "",
        dst_incarnation: int = 0,
    ) -> TransferResult:
        """Hands ``src_blocks[i]`` of this engine to ``dst_blocks[i]`` of
        engine ``dst_engine`` (every layer and plane; with a TP split, this
        destination rank's heads), or the byte ``extents`` (src_offset,
        dst_offset, len) for non-paged pools. Blocks until it resolves and
        returns the :class:`TransferResult` (an unsuccessful outcome is a
        result, not an exception). ``path`` "auto", "bounce" or
        "standard"; ``timeout_ms`` bounds the request (0 = the agent's
        requestTimeoutMs); ``traceparent`` a W3C trace context;
        ``dst_incarnation`` the destination's :attr:`incarnation` when it
        allocated ``dst_blocks`` (0: not checked) — a destination that
        re-attached since is refused, nothing written.

        Raises InvalidArgument (block out of range, lists of different
        lengths), NotFound (unknown destination engine or session),
        FailedPrecondition (layouts that cannot be mapped, both named; or
        the destination re-attached since ``dst_incarnation``)."""
        req, extra = self._transfer_request(
            request_id, dst_engine, src_blocks, dst_blocks, extents, path, timeout_ms, traceparent,
            dst_incarnation,
        )
        return TransferResult._from(request_id, self._core.client._unary("Transfer", req, extra))

    transfer = transfer_blocks

    def transfer_async(
        self,
        request_id: int,
        dst_engine: str,
        src_blocks: Optional[Sequence[int]] = None,
        dst_blocks: Optional[Sequence[int]] = None,
        *,
        extents: Optional[Extents] = None,
        path: Union[str, int] = "auto",
        timeout_ms: int = 0,
        traceparent: str = "",
        dst_incarnation: int = 0,
    ) -> "Future[TransferResult]":
        """:meth:`transfer_blocks` without blocking: a
        ``concurrent.futures.Future`` of the :class:`TransferResult` (or of
        the typed error). ``asyncio.wrap_future`` makes it awaitable."""
        req, extra = self._transfer_request(
            request_id, dst_engine, src_blocks, dst_blocks, extents, path, timeout_ms, traceparent,
            dst_incarnation,
        )
        return self._core.client._unary_future(
            "Transfer", req, extra, lambda r: TransferResult._from(request_id, r)
        )

    def _arrival_request(
        self, request_id: int, src_engine: str, timeout: Optional[float]
    ) -> Tuple[pb.AwaitArrivalRequest, float]:
        ms = 0 if not timeout else max(1, min(int(timeout * 1000), 0xFFFFFFFF))
        req = pb.AwaitArrivalRequest(
            session=self.id, request_id=request_id, src_engine=src_engine, timeout_ms=ms
        )
        return req, (ms / 1000.0 if ms else AGENT_DEFAULT_WAIT)

    def await_arrival(
        self, request_id: int, src_engine: str = "", timeout: Optional[float] = None
    ) -> ArrivalResult:
        """Decode side: blocks until every byte of request ``request_id``
        (from ``src_engine``, or any source when empty) has landed in this
        engine's blocks, at most ``timeout`` seconds (None/0 = the agent's
        request timeout). Returns the :class:`ArrivalResult`."""
        req, extra = self._arrival_request(request_id, src_engine, timeout)
        return ArrivalResult._from(request_id, self._core.client._unary("AwaitArrival", req, extra))

    def await_arrival_async(
        self, request_id: int, src_engine: str = "", timeout: Optional[float] = None
    ) -> "Future[ArrivalResult]":
        """:meth:`await_arrival` without blocking (a concurrent Future)."""
        req, extra = self._arrival_request(request_id, src_engine, timeout)
        return self._core.client._unary_future(
            "AwaitArrival", req, extra, lambda r: ArrivalResult._from(request_id, r)
        )

    def cancel(self, request_id: int) -> bool:
        """Cancels in-flight request ``request_id`` of this session; False
        when no such request was in flight or it cannot be recalled (the
        standard path, a same-agent copy). A request still being routed when
        the cancel comes (``status()`` lists it with path ``"pending"``) is
        accepted when it can only move by bounce (``path="bounce"``, or auto
        with a GPU pool on either side) and cancelled once submitted: its
        result is ``"cancelled"``."""
        r = self._core.client._unary("Cancel", pb.CancelRequest(session=self.id, request_id=request_id))
        return bool(r.cancelled)

    def status(self) -> SessionStatus:
        """In-flight requests, counters and pool length of this session."""
        return SessionStatus._from(self._core.client._unary("Status", pb.StatusRequest(session=self.id)))

    # -- ending ------------------------------------------------------------

    def detach(self) -> None:
        """Ends the session (Detach, then the stream): in-flight requests
        fail, the pool is unregistered once nothing uses it. Raises the
        Detach error (e.g. NotFound when the agent had already dropped the
        session); the session is closed either way."""
        if self._core.closed:
            raise SessionClosed("the session was closed already", call="Detach")
        err = self._core.close(detach=True)
        self._finalizer.detach()
        if err is not None:
            raise err

    def close(self) -> None:
        """Like :meth:`detach` but never raises (idempotent)."""
        self._core.close(detach=True)
        self._finalizer.detach()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        a = self._core.attached
        sid = a.session if a is not None else "?"
        state = "open" if self.is_open else ("closed" if self.closed else "not attached")
        return f"Session(engine_id={self.engine_id!r}, id={sid!r}, {state})"


__all__ = [
    "AlreadyExists",
    "ArrivalResult",
    "Client",
    "InFlight",
    "Session",
    "SessionStatus",
    "TransferResult",
]
