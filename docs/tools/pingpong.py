#!/usr/bin/env python3
"""TCP loopback ping-pong between two processes: busy-polled vs blocking receive.
Prints the median / p99 one-way latency (RTT/2) in µs per message size."""
import os, socket, statistics, sys, time

def recv_exact(s, n, busy):
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
            if not chunk: raise EOFError
            buf += chunk
        except BlockingIOError:
            if not busy: raise
    return bytes(buf)

def serve(port, busy):
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("127.0.0.1", port)); l.listen(1)
    c, _ = l.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.setblocking(not busy)
    try:
        while True:
            hdr = recv_exact(c, 4, busy); n = int.from_bytes(hdr, "little")
            body = recv_exact(c, n, busy)
            c.setblocking(True); c.sendall(hdr + body); c.setblocking(not busy)
    except (EOFError, ConnectionResetError):
        pass

def client(port, busy, size, iters=2000, gap=0.0):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = len(b"x" * size).to_bytes(4, "little") + b"x" * size
    lat = []
    for i in range(iters):
        if gap:
            time.sleep(gap)
        t = time.perf_counter_ns()
        s.setblocking(True); s.sendall(msg); s.setblocking(not busy)
        recv_exact(s, 4, busy); recv_exact(s, size, busy)
        lat.append((time.perf_counter_ns() - t) / 2000.0)
    s.close()
    lat = lat[100:]; lat.sort()
    return statistics.median(lat), lat[int(len(lat) * 0.99)]

if __name__ == "__main__":
    port = 47000
    for gap in (0.0, 0.005):
        for busy in (True, False):
            for size in (64, 100_000):
                port += 1
                pid = os.fork()
                if pid == 0:
                    serve(port, busy); os._exit(0)
                time.sleep(0.3)
                med, p99 = client(port, busy, size, iters=600 if gap else 2000, gap=gap)
                os.waitpid(pid, 0)
                print(f"gap {gap*1000:3.0f} ms {'busy-poll' if busy else 'blocking '} {size:>7} B: one-way median {med:7.1f} µs, p99 {p99:7.1f} µs")
