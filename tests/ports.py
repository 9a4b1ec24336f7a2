"""Ports for tests that must name a server's address before it starts (a cluster's members)."""

import os
import socket

LOW, SPAN = 20_000, 12_000
_next = 0


def free_ports(n: int) -> list[int]:
    """`n` ports below the kernel's ephemeral range (32768 and up here), each checked free when
    handed out. Not bind(0)'s: a port it hands out and the test releases is drawn again by the
    next socket of any process that binds port 0 or connects out (a node's own gRPC or metrics
    listener, a peer's connection), and the node that should bind it then cannot start."""
    global _next
    base = os.getpid() * 7919 % SPAN
    out = []
    while len(out) < n:
        assert _next < SPAN, "no free port left below the ephemeral range"
        port = LOW + (base + _next) % SPAN
        _next += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    return out
