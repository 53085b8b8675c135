"""What plain TCP over loopback carries between two processes: the ceiling of any TCP transport.

`pdserve bench kv` reports it next to the memcpy reference, so the gRPC figure can be read
against what its wire can do at all on this machine. A child process `sendall`s `num_bytes`
from a pre-touched buffer; the parent `recv_into`s a pre-touched buffer (no per-message
allocation, no framing): nothing a real transport does less of.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time

import torch

from engine.worker.host_memory import zeros_on_huge_pages

_RECV_BYTES = 16 << 20


def _send(port: int, num_bytes: int, repeats: int) -> None:
    payload = zeros_on_huge_pages((num_bytes,), torch.uint8).fill_(7).numpy().data
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(repeats):
            sock.sendall(payload)
            sock.recv(1)  # the reader's "got it": repeats do not overlap


def tcp_loopback_gbps(num_bytes: int, repeats: int, timeout_s: float = 120.0) -> float:
    """Median GB/s of `repeats` transfers of `num_bytes` from a child process over 127.0.0.1."""
    buffer = zeros_on_huge_pages((num_bytes,), torch.uint8).numpy().data
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(timeout_s)
        port = server.getsockname()[1]
        sender = mp.get_context("spawn").Process(
            target=_send, args=(port, num_bytes, repeats + 1), daemon=True
        )
        sender.start()
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout_s)
                _receive(conn, buffer)  # warm-up: TCP windows grow, pages are touched
                seconds = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    _receive(conn, buffer)
                    seconds.append(time.perf_counter() - t0)
        finally:
            sender.join(timeout_s)
            if sender.is_alive():
                sender.kill()
    return num_bytes / statistics.median(seconds) / 1e9


def _receive(conn: socket.socket, buffer: memoryview) -> None:
    got = 0
    while got < len(buffer):
        n = conn.recv_into(buffer[got:], min(_RECV_BYTES, len(buffer) - got))
        if n == 0:
            raise ConnectionError(f"sender closed after {got} of {len(buffer)} bytes")
        got += n
    conn.sendall(b"k")
