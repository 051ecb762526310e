"""Open-loop HTTPS load: requests at fixed arrival times, latency from each one's intended send time.

A closed-loop client (one request in flight, the next sent when the answer came) hides a stall: the
requests that would have arrived during it are never sent, and the stall counts as one slow sample
(coordinated omission). Here request i is due at start + i / rate whatever happened before it; it
goes out on an idle keep-alive connection (a new one is opened when none is idle, up to
`max_connections`), and its latency runs from its due time to the last byte of its answer, so the
time a request waits behind a stall, or behind this client, counts.

A warm-up (`warmup_s`) sends at the same rate before the timed requests and is reported on its own:
a server's first requests pay for its new connections and its cold caches (a review worker's first
evaluation of a selector), a start-up cost that would otherwise be most of a 3,000-sample p99.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

# The requests of one run: (method, path, body or None) for request i.
Requests = Callable[[int], tuple[str, str, bytes | None]]
# Raises on an answer that is not what the request should get (status, body).
Check = Callable[[int, int, bytes], None]


@dataclass
class OpenLoopResult:
    rate: float
    sent: int
    elapsed_s: float
    latency_ms: dict[str, list[float]] = field(default_factory=dict)  # by path
    warmup_ms: dict[str, list[float]] = field(default_factory=dict)  # by path: the warm-up's requests
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)  # (path, HTTP status): timed requests
    connections: int = 0
    max_send_lag_ms: float = 0.0  # how late this client sent a request: its own share of the latency


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def request(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body or b'')}\r\n\r\n"
        self.writer.write(head.encode() + (body or b""))
        async with asyncio.timeout(timeout):
            raw = await self.reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            if "content-length" not in headers:
                raise RuntimeError(f"{path}: an answer without Content-Length: {headers}")
            payload = await self.reader.readexactly(int(headers["content-length"]))
        return status, payload


async def open_loop(
    host: str,
    port: int,
    ctx: ssl.SSLContext,
    rate: float,
    seconds: float,
    requests: Requests,
    check: Check,
    max_connections: int = 256,
    timeout: float = 30.0,
    warmup_s: float = 0.0,
) -> OpenLoopResult:
    warmup = round(rate * warmup_s)
    total = warmup + round(rate * seconds)
    result = OpenLoopResult(rate=rate, sent=total - warmup, elapsed_s=0.0)
    idle: list[_Connection] = []
    slots = asyncio.Semaphore(max_connections)

    async def one(i: int, due: float) -> None:
        method, path, body = requests(i)
        async with slots:
            if idle:
                conn = idle.pop()
            else:
                reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
                conn = _Connection(reader, writer)
                result.connections += 1
            status, payload = await conn.request(method, path, body, timeout)
            took = (time.perf_counter() - due) * 1e3
            idle.append(conn)
        check(i, status, payload)
        if i < warmup:
            result.warmup_ms.setdefault(path, []).append(took)
        else:
            result.latency_ms.setdefault(path, []).append(took)
            result.statuses[(path, status)] += 1

    tasks = []
    start = timed_start = time.perf_counter() + 0.05
    for i in range(total):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if i == warmup:
            timed_start = due
        if i >= warmup:
            result.max_send_lag_ms = max(result.max_send_lag_ms, (time.perf_counter() - due) * 1e3)
        tasks.append(asyncio.create_task(one(i, due)))
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for conn in idle:
            conn.writer.close()
    result.elapsed_s = time.perf_counter() - timed_start
    return result
