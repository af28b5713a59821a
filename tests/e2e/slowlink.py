"""An emulated slow link: a TCP proxy on loopback that delays and paces bytes both ways.

There is no `tc netem` here; a `LinkProxy` in front of a server holds every byte `delay_s`
in each direction and lets it out no faster than `rate_bps`, in its own thread and event
loop, so the servers and clients on either side are the real ones. `benchmarks/wan.py`
puts one in front of every node; the tests put one in front of a single hop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from tests.e2e.procs import free_port


@dataclass
class Link:
    """One emulated link: one-way delay and rate, changeable while it carries traffic."""

    delay_s: float = 0.0
    rate_bps: float | None = None  # bits per second; None = unlimited
    # the rate is the link's, shared by all its connections (a node's uplink), not each
    # connection's own
    shared: bool = False


class LinkProxy:
    """A TCP proxy on 127.0.0.1 that delays and paces bytes both ways (its own thread)."""

    def __init__(self, upstream_port: int, link: Link) -> None:
        self.upstream_port = upstream_port
        self.link = link
        self.port = free_port()
        self.free_at: dict[str, float] = {}  # per direction, when the link is shared
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._connect, "127.0.0.1", self.port)
        )
        started.set()
        self.loop.run_forever()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_writer, "up"), self._pump(up_reader, writer, "down")
        )

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str
    ) -> None:
        """Bytes from `reader` reach `writer` `delay` later, no faster than the rate."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer))
        free_at = 0.0  # when the link finishes serializing what it was given so far
        try:
            while data := await reader.read(65536):
                now = time.monotonic()
                rate = self.link.rate_bps
                if self.link.shared:
                    free_at = self.free_at.get(direction, 0.0)
                free_at = max(free_at, now) + (len(data) * 8 / rate if rate else 0.0)
                self.free_at[direction] = free_at
                queue.put_nowait((free_at + self.link.delay_s, data))
        except OSError:
            pass
        queue.put_nowait((0.0, b""))  # end of stream
        await sender

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                break
        writer.close()
