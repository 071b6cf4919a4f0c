"""A small in-process stand-in for the agent's engine API (gRPC server on a
Unix socket), for testing the client's own mechanics without the Rust agent:
the Attach stream and session life, deadlines, futures, error mapping,
re-attach after a restart. Transfers are local copies between engines
attached to this fake, by the layout formula (equal layouts only).
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent import futures
from multiprocessing import shared_memory
from typing import Dict, Optional

import grpc

from kvfabric._proto import engine_pb2 as pb
from kvfabric._proto import engine_pb2_grpc as pb_grpc
from kvfabric.layout import Layout


class _Sess:
    def __init__(self, sid: str, req: pb.AttachRequest) -> None:
        self.id = sid
        self.engine_id = req.engine_id
        self.layout = Layout.from_proto(req.layout)
        self.shm: Optional[shared_memory.SharedMemory] = None
        self.pool_len = 0
        self.ended = threading.Event()
        self.arrivals: Dict[int, int] = {}  # request id -> bytes
        self.in_flight: Dict[int, threading.Event] = {}
        self.succeeded = 0


class FakeAgent(pb_grpc.EngineApiServicer):
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.lock = threading.Condition()
        self.sessions: Dict[str, _Sess] = {}
        self.ids = itertools.count(1)
        self.incarnation = 0
        self.server: Optional[grpc.Server] = None
        # Knobs for the tests.
        self.hold = threading.Event()  # set: transfers wait until cleared
        self.hold.clear()
        self.release = threading.Event()
        self.delay_status = 0.0
        self.first_event: Optional[pb.SessionEvent] = None
        self.attach_calls = 0

    # -- life -------------------------------------------------------------

    def start(self) -> "FakeAgent":
        self.incarnation += 1
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_EngineApiServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix:" + self.socket_path)
        self.server.start()
        return self

    def stop(self) -> None:
        """Like an agent dying: every stream and call ends (the server stops
        first, so no held call can still answer)."""
        stopped = self.server.stop(grace=None) if self.server is not None else None
        self.server = None
        with self.lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
            self.lock.notify_all()
        for s in sessions:
            s.ended.set()
        self.release.set()
        if stopped is not None:
            stopped.wait()
        for s in sessions:
            if s.shm is not None:
                try:
                    s.shm.close()
                except BufferError:
                    pass

    def live_engines(self) -> list:
        with self.lock:
            return sorted(s.engine_id for s in self.sessions.values())

    def _session(self, sid: str, context: grpc.ServicerContext) -> _Sess:
        with self.lock:
            s = self.sessions.get(sid)
        if s is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {sid!r}")
        return s  # type: ignore[return-value]

    # -- the API ----------------------------------------------------------

    def Attach(self, request, context):
        self.attach_calls += 1
        if self.first_event is not None:
            yield self.first_event
            return
        layout = Layout.from_proto(request.layout)
        try:
            layout.validate()
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self.lock:
            if any(s.engine_id == request.engine_id for s in self.sessions.values()):
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"engine {request.engine_id!r} is attached already"
                )
            sid = f"s{self.incarnation}-{next(self.ids)}"
            sess = _Sess(sid, request)
            self.sessions[sid] = sess
        context.add_callback(sess.ended.set)
        try:
            yield pb.SessionEvent(
                attached=pb.Attached(
                    session=sid, agent=f"fake-{self.incarnation}", layout_fingerprint=layout.fingerprint()
                )
            )
            while context.is_active() and not sess.ended.wait(0.2):
                yield pb.SessionEvent(heartbeat=pb.Heartbeat())
        finally:
            with self.lock:
                self.sessions.pop(sid, None)
                self.lock.notify_all()

    def RegisterPool(self, request, context):
        s = self._session(request.session, context)
        if request.WhichOneof("memory") != "shm":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "the fake agent maps shm only")
        if s.shm is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a pool is registered already")
        name = request.shm.name
        if not name.startswith("/"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"shm name {name!r} must start with '/'")
        if request.shm.len < s.layout.pool_bytes():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "pool smaller than the layout")
        try:
            shm = shared_memory.SharedMemory(name=name[1:], create=False)
        except FileNotFoundError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"shm {name}: no such object")
        try:
            from multiprocessing import resource_tracker

            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:
            pass
        s.shm = shm
        s.pool_len = request.shm.len
        return pb.RegisterPoolResponse(len=request.shm.len)

    def Transfer(self, request, context):
        s = self._session(request.session, context)
        with self.lock:
            dst = next((d for d in self.sessions.values() if d.engine_id == request.dst_engine), None)
        if dst is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown engine {request.dst_engine!r}")
        if s.layout.fingerprint() != dst.layout.fingerprint():
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"layouts cannot be mapped (source {s.layout}; destination {dst.layout})",
            )
        if len(request.src_blocks) != len(request.dst_blocks):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lists of different lengths")
        for b in request.src_blocks:
            if b >= s.layout.num_blocks:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"src block {b} out of range")
        for b in request.dst_blocks:
            if b >= dst.layout.num_blocks:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dst block {b} out of range")
        t0 = time.monotonic()
        ev = threading.Event()
        s.in_flight[request.request_id] = ev
        cancelled = False
        try:
            if self.hold.is_set():
                # Held: wait for release, cancel, or our death.
                while not ev.wait(0.05):
                    if self.release.is_set() or not context.is_active():
                        break
                cancelled = ev.is_set() and not self.release.is_set()
        finally:
            s.in_flight.pop(request.request_id, None)
        if cancelled:
            return pb.TransferResponse(outcome=pb.OUTCOME_CANCELLED, reason="cancelled by the engine")
        if s.shm is None or dst.shm is None:
            return pb.TransferResponse(outcome=pb.OUTCOME_FAILURE, reason="no pool registered")
        n = 0
        L = s.layout
        for layer in range(L.layers):
            for plane in range(L.planes):
                for sb, db in zip(request.src_blocks, request.dst_blocks):
                    so = L.block_offset(layer, plane, sb)
                    do = dst.layout.block_offset(layer, plane, db)
                    dst.shm.buf[do : do + L.block_bytes] = s.shm.buf[so : so + L.block_bytes]
                    n += L.block_bytes
        with self.lock:
            dst.arrivals[request.request_id] = n
            s.succeeded += 1
            self.lock.notify_all()
        return pb.TransferResponse(
            outcome=pb.OUTCOME_SUCCESS,
            path="direct",
            bytes=n,
            descriptors=L.layers * L.planes * len(request.src_blocks),
            transfer_us=int((time.monotonic() - t0) * 1e6),
        )

    def AwaitArrival(self, request, context):
        s = self._session(request.session, context)
        timeout = (request.timeout_ms or 30_000) / 1000.0
        deadline = time.monotonic() + timeout
        with self.lock:
            while request.request_id not in s.arrivals:
                left = deadline - time.monotonic()
                if left <= 0 or s.ended.is_set():
                    return pb.AwaitArrivalResponse(outcome=pb.OUTCOME_TIMEOUT, reason="no arrival")
                self.lock.wait(min(left, 0.1))
            return pb.AwaitArrivalResponse(
                outcome=pb.OUTCOME_SUCCESS, bytes=s.arrivals[request.request_id]
            )

    def Cancel(self, request, context):
        s = self._session(request.session, context)
        ev = s.in_flight.get(request.request_id)
        if ev is None:
            return pb.CancelResponse(cancelled=False)
        ev.set()
        return pb.CancelResponse(cancelled=True)

    def Status(self, request, context):
        if self.delay_status:
            time.sleep(self.delay_status)
        s = self._session(request.session, context)
        return pb.StatusResponse(
            engine_id=s.engine_id,
            in_flight=[pb.InFlight(request_id=r) for r in list(s.in_flight)],
            transfers_succeeded=s.succeeded,
            arrivals=len(s.arrivals),
            pool_len=s.pool_len,
        )

    def Detach(self, request, context):
        s = self._session(request.session, context)
        with self.lock:
            self.sessions.pop(s.id, None)
        s.ended.set()
        return pb.DetachResponse()
