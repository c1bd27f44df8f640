"""Tasks for checking the virtual cluster's emulation (tests/test_cluster_emulation.py), started in
a host through ``ip netns exec``; each prints one JSON line.

    spin N              a fixed CPU-bound loop of N iterations: {"wall", "cpu"} of the loop
    recv PORT BYTES     accepts one connection on PORT and reads BYTES: {"wall"} from the first byte
    send ADDR PORT BYTES  connects to ADDR:PORT and writes BYTES: {"wall"}
    pong PORT N         echoes N one-byte messages on one connection
    ping ADDR PORT N    N one-byte round trips: {"rtt"} (median seconds)
"""

import json
import socket
import statistics
import sys
import time


def spin(n):
    t0, c0 = time.perf_counter(), time.process_time()
    x = 0
    for i in range(n):
        x += i * i & 7
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "x": x}


def _listen(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(1)
    s.settimeout(120)
    conn, _ = s.accept()
    s.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _connect(addr, port):
    deadline = time.time() + 60
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=120)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def recv(port, nbytes):
    conn = _listen(port)
    buf = bytearray(1 << 20)
    got, t0 = 0, None
    while got < nbytes:
        k = conn.recv_into(buf)
        if not k:
            break
        if t0 is None:
            t0 = time.perf_counter()
        got += k
    wall = time.perf_counter() - t0
    conn.sendall(b"k")  # the sender's clock stops when everything arrived
    conn.close()
    return {"wall": wall, "bytes": got}


def send(addr, port, nbytes):
    s = _connect(addr, port)
    chunk = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        left -= s.send(chunk[:min(left, len(chunk))])
    s.recv(1)
    wall = time.perf_counter() - t0
    s.close()
    return {"wall": wall, "bytes": nbytes}


def pong(port, n):
    conn = _listen(port)
    for _ in range(n):
        conn.sendall(conn.recv(1))
    conn.close()
    return {}


def ping(addr, port, n):
    s = _connect(addr, port)
    rtts = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.sendall(b"x")
        s.recv(1)
        rtts.append(time.perf_counter() - t0)
    s.close()
    return {"rtt": statistics.median(rtts[1:])}


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    fn = {"spin": spin, "recv": recv, "send": send, "pong": pong, "ping": ping}[cmd]
    out = fn(*[a if "." in a and cmd in ("send", "ping") and i == 0 else int(a)
               for i, a in enumerate(args)])
    print(json.dumps(out), flush=True)
