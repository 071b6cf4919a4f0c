"""Fixtures for the tests against real agents: a single-member etcd on free
loopback ports, and `kvfabric agent` daemons (target/debug/kvfabric or
$KVFABRIC_BIN) serving the engine API on a Unix socket.

Tests that need them skip, with the reason printed (pytest -rs), when the
agent binary or etcd is missing; with KVFABRIC_REQUIRE_SERVICES=1 (CI) they
fail instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # fake_agent, helpers

REPO = Path(os.environ.get("KVFABRIC_REPO", HERE.parents[2])).resolve()

# The agents' bounce configuration: small arena, every request bounced.
BOUNCE_ENV = {
    "KVFABRIC_BOUNCE_ENABLE": "1",
    "KVFABRIC_BOUNCE_ARENA_SIZE_BYTES": "16MiB",
    "KVFABRIC_BOUNCE_ARENA_ALLOCATION_GRANULARITY_BYTES": "64KiB",
    "KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES": "2MiB",
    "KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT": "1",
}


def require(ok: bool, reason: str) -> None:
    """Skips (or, under KVFABRIC_REQUIRE_SERVICES=1, fails) when a service
    the test needs is missing."""
    if ok:
        return
    if os.environ.get("KVFABRIC_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (KVFABRIC_REQUIRE_SERVICES=1: not skipping)", pytrace=False)
    print(f"SKIP: {reason}", file=sys.stderr)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_bin() -> Optional[Path]:
    p = os.environ.get("KVFABRIC_BIN")
    path = Path(p) if p else REPO / "target" / "debug" / "kvfabric"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def etcd_bin() -> Optional[str]:
    p = os.environ.get("KVFABRIC_ETCD_BIN")
    if p:
        return p if os.path.isfile(p) else None
    return shutil.which("etcd") or ("/usr/bin/etcd" if os.path.isfile("/usr/bin/etcd") else None)


def tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class Etcd:
    def __init__(self, binary: str, workdir: Path) -> None:
        self.dir = workdir / "etcd"
        self.dir.mkdir(parents=True)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.log = self.dir / "etcd.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary, "--name", "kvfabric", "--data-dir", str(self.dir / "data"),
                    "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"kvfabric={peer}", "--logger", "zap", "--log-level", "warn",
                ],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy; log:\n{tail(self.log)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Agent:
    """A `kvfabric agent` daemon serving the engine API on `socket_path`."""

    def __init__(self, binary: Path, etcd: Etcd, fabric: str, logical_id: str, role: str, workdir: Path) -> None:
        self.binary = binary
        self.etcd = etcd
        self.fabric = fabric
        self.logical_id = logical_id
        self.role = role
        self.socket_path = str(workdir / f"{logical_id}.sock")
        self.log = workdir / f"{logical_id}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.addr = ""
        self.starts = 0

    def start(self, timeout: float = 60.0) -> "Agent":
        assert self.proc is None or self.proc.poll() is not None
        env = os.environ.copy()
        env.update(BOUNCE_ENV)
        env.setdefault("KVFABRIC_LOG", "info")
        env["NO_COLOR"] = "1"
        argv = [
            str(self.binary), "agent",
            "--engine-socket", self.socket_path,
            "--listen", "127.0.0.1:0",
            "--control-bind", "loopback",
            "--pool-size", "16MiB",
            "--logical-id", self.logical_id,
            "--role", self.role,
            "--etcd", self.etcd.url,
            "--fabric", self.fabric,
            "--lease-ttl", "5",
        ]
        self.starts += 1
        logf = open(self.log, "ab")
        logf.write(f"\n===== start {self.starts}: {' '.join(argv)}\n".encode())
        logf.flush()
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logf
        )
        logf.close()
        ready = threading.Event()
        proc = self.proc

        def read_stdout() -> None:
            assert proc.stdout is not None
            with open(self.log, "ab") as out:
                for line in proc.stdout:
                    out.write(b"[stdout] " + line)
                    out.flush()
                    text = line.decode(errors="replace")
                    if "listening on http://" in text and not ready.is_set():
                        self.addr = text.split("listening on http://", 1)[1].strip()
                        ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"agent {self.logical_id} did not announce its address "
                    f"(exit {proc.returncode}); log:\n{tail(self.log)}"
                )
        while not os.path.exists(self.socket_path):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"agent {self.logical_id} announced {self.addr} but {self.socket_path} "
                    f"does not exist; log:\n{tail(self.log)}"
                )
            time.sleep(0.05)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.alive():
            self.proc.kill()  # type: ignore[union-attr]
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        """SIGTERM (a graceful shutdown); SIGKILL past `timeout`. The exit
        code, None when it had to be killed."""
        if not self.alive():
            return self.proc.returncode if self.proc is not None else None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            self.kill()
            return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(scope="session")
def workdir() -> Iterator[Path]:
    # Short: Unix socket paths are limited to 107 bytes.
    d = Path(tempfile.mkdtemp(prefix="kvf-py-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def kvfabric_bin() -> Path:
    b = agent_bin()
    require(
        b is not None,
        f"kvfabric agent binary not found ({os.environ.get('KVFABRIC_BIN') or REPO / 'target/debug/kvfabric'}; "
        "build it with `cargo build -p kvfabric-agent --bin kvfabric` or set KVFABRIC_BIN)",
    )
    assert b is not None
    return b


@pytest.fixture(scope="session")
def etcd(workdir: Path) -> Iterator[Etcd]:
    b = etcd_bin()
    require(b is not None, "etcd not installed (run e2e/setup.sh, or set KVFABRIC_ETCD_BIN)")
    assert b is not None
    e = Etcd(b, workdir)
    yield e
    e.stop()


class Agents:
    """Starts agents in a fabric of their own; stops them all at the end and
    prints their logs' tails when the test failed."""

    def __init__(self, binary: Path, etcd: Etcd, workdir: Path) -> None:
        self.binary = binary
        self.etcd = etcd
        self.fabric = f"py-{uuid.uuid4().hex[:8]}"
        self.dir = workdir / self.fabric
        self.dir.mkdir()
        self.agents: List[Agent] = []

    def start(self, logical_id: str, role: str) -> Agent:
        a = Agent(self.binary, self.etcd, self.fabric, logical_id, role, self.dir)
        self.agents.append(a)
        return a.start()

    def close(self, failed: bool) -> None:
        for a in self.agents:
            a.stop()
        if failed:
            for a in self.agents:
                print(f"\n----- {a.logical_id} log (tail) -----\n{tail(a.log, 80)}", file=sys.stderr)


@pytest.fixture(scope="module")
def pair(request, kvfabric_bin: Path, etcd: Etcd, workdir: Path):
    """Two agents shared by a module's tests: `a` (prefill) and `b`
    (decode) in one fabric."""
    agents = Agents(kvfabric_bin, etcd, workdir)
    a = agents.start("node-a", "prefill")
    b = agents.start("node-b", "decode")
    yield a, b
    failed = any(getattr(item, "rep_call", None) is not None and item.rep_call.failed
                 for item in request.session.items if item.module is request.module)
    agents.close(failed)


@pytest.fixture
def fresh_pair(request, kvfabric_bin: Path, etcd: Etcd, workdir: Path):
    """Two agents of the test's own (it may stop, kill or restart them)."""
    agents = Agents(kvfabric_bin, etcd, workdir)
    a = agents.start("node-a", "prefill")
    b = agents.start("node-b", "decode")
    yield a, b
    rep = getattr(request.node, "rep_call", None)
    agents.close(rep is None or rep.failed)
