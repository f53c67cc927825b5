"""What one client can cost the retriever server (DESIGN.md section 12): a cap on open connections
answered with 503, a budget of file descriptors, deadlines for a request's head and body, and log
lines that cannot flood. DEVIATION S12 and S16 act here. It knows nothing of retrieval: server.py
builds its server from these pieces.
"""
import collections
import errno
import json
import logging
import math
import os
import socket
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

# listen queue (uvicorn's default; http.server's 5 dropped SYNs: 1 s retransmit tails)
BACKLOG = 2048
# seconds a client may take to send a request head, then its body
HEAD_TIMEOUT, BODY_TIMEOUT = 30.0, 60.0
# descriptors kept free beside the connection cap: the event loop's own, a refusal's, log files
FD_RESERVE = 32
# seconds between two log lines of one kind (refused connections, descriptor exhaustion)
LOG_INTERVAL = 5.0
# accept errors asyncio pauses on
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# seconds asyncio stops accepting after one of them (asyncio.constants.ACCEPT_RETRY_DELAY)
ACCEPT_PAUSE = 1.0
# uvicorn's own log (level warning): one stream for the server
LOG = logging.getLogger("uvicorn.error")


class Throttled:
    """Log lines for events that may come thousands of times a second: one line per kind every
    `interval` s, which counts the events held back since the last one."""

    def __init__(self, interval: float = LOG_INTERVAL):
        self.interval, self._last, self._held = interval, {}, collections.Counter()

    def __call__(self, kind: str, message: str):
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < self.interval:
            self._held[kind] += 1
            return
        held, self._held[kind], self._last[kind] = self._held[kind], 0, now
        LOG.warning(message +
                    (f" ({held} more like it in the last {self.interval:g} s)" if held else ""))


def descriptor_limit() -> int:
    """This process's limit on open files (ulimit -n), or a large number where there is none."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit on this system
        return 1 << 20
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def descriptor_budget() -> int:
    """Connections this process can hold: its descriptor limit, less the descriptors open now, less
    FD_RESERVE."""
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        used = len(os.listdir(folder))
    except OSError:
        used = 64
    return max(1, descriptor_limit() - used - FD_RESERVE)


class Connections:
    """Open connections against their cap; shared by the listening socket and the protocol, both on
    the loop's thread."""

    def __init__(self, cap: int):
        self.cap, self.open, self.paused_until, self.log = cap, 0, 0.0, Throttled()

    def refuse(self, sock: socket.socket):
        """503 and close at once: the client learns to retry (RemoteRetriever does), no descriptor
        is held."""
        body = json.dumps({
            "error": f"the server holds {self.open} connections, its cap (--max_connections); "
            "retry later"
        }).encode()
        try:
            sock.setblocking(False)
            try:
                # what has arrived: closing with unread data would reset the connection
                sock.recv(1 << 16)
            except BlockingIOError:
                pass
            sock.send(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
        finally:
            sock.close()
        self.log(
            "refused",
            f"refused a connection with 503: {self.open} open, the cap (--max_connections {self.cap})"
        )


class ListeningSocket(socket.socket):
    """The server's listening socket. asyncio's accept loop (CPython 3.11) calls accept() up to
    BACKLOG times per wake-up and, out of descriptors, logs a traceback, schedules a retry in 1 s
    and goes on calling: ~56k traceback lines a second with idle connections at the descriptor
    limit. Here a connection past the cap is answered 503 and closed at once, and after an
    out-of-descriptors error accept() reports nothing waiting until asyncio's pause has begun: one
    error per pause, and a log line per LOG_INTERVAL (`RetrievalServer._loop_error`). DEVIATION S16.
    """
    connections: Connections

    def accept(self):
        while True:
            if time.monotonic() < self.connections.paused_until:
                raise BlockingIOError(errno.EAGAIN, "accepting is paused")
            try:
                sock, address = super().accept()
            except OSError as e:
                if e.errno in OUT_OF_RESOURCES:
                    self.connections.paused_until = time.monotonic() + ACCEPT_PAUSE / 2
                raise
            if self.connections.open < self.connections.cap:
                self.connections.open += 1  # until the protocol's connection_lost
                return sock, address
            self.connections.refuse(sock)


class DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request head: uvicorn has none, so a client
    that connects and then sends nothing (or a byte now and then) would hold its connection for
    ever. DEVIATION S12. It also gives the connection's place back to the cap (`Connections`) when
    the connection ends."""
    # slots: the server's Connections (uvicorn's own: `connections`)
    head_timeout, slots = HEAD_TIMEOUT, None

    def connection_lost(self, exc):
        if self.slots is not None:
            self.slots.open -= 1
        super().connection_lost(exc)

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self):
        super().on_response_complete()
        self._arm_head_deadline()

    def _arm_head_deadline(self):
        cycle = self.cycle  # replaced as soon as the next request head is complete
        self.loop.call_later(
            self.head_timeout, lambda: self.cycle is cycle and not self.transport.is_closing() and
            self.transport.close())
