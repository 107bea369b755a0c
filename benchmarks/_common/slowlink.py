"""A slow, far link in user space: two TAP devices joined by a forwarder that delays frames.

``tc netem`` is how a kernel adds latency to a link; a kernel built without ``sch_netem``
(this project's CI machine) cannot. This is the same link in user space: each emulated host
gets a TAP device (an Ethernet interface whose frames a process reads and writes), and one
thread of this process carries every frame from one device to the other as a link of the
given rate and one-way delay would: a frame starts when the frames before it in its direction
have been sent (serialisation at ``rate``), and arrives ``delay`` after it has been sent.
Like netem, a direction holds at most ``limit`` frames in flight and drops the rest (TCP
then slows down, as on a real link).

The TAP devices are made in this process's namespace, opened (the file descriptor keeps the
device), then moved into the hosts' namespaces; :class:`~benchmarks._common.netns.TwoHosts`
uses it in place of its veth pair where it is asked for latency and the kernel has no netem.
What it cannot show: a frame's timing is this thread's, so on a loaded machine a frame may
arrive a few hundred microseconds late; against a 50 ms delay that is below 1 %.
"""

from __future__ import annotations

import collections
import fcntl
import os
import select
import struct
import threading
import time

TUNSETIFF = 0x400454CA
"""``ioctl`` that attaches a ``/dev/net/tun`` descriptor to a named device."""
IFF_TAP = 0x0002
"""An Ethernet device (frames with MAC headers: ARP works as on any link)."""
IFF_NO_PI = 0x1000
"""No packet-information prefix: a read is one frame as it would go on the wire."""
DEFAULT_LIMIT = 1000
"""Frames a direction holds at most (netem's default queue)."""
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text: str) -> float:
    """``10mbit`` (tc's units: bit, kbit, mbit, gbit) as bits a second.

    Raises:
        ValueError: For a rate in another form, naming it.
    """
    low = text.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if low.endswith(unit):
            try:
                value = float(low[: -len(unit)]) * _UNITS[unit]
            except ValueError:
                break
            if value > 0:
                return value
    raise ValueError(f"rate {text!r}: give a number > 0 with bit, kbit, mbit or gbit (10mbit)")


def parse_delay(text: str) -> float:
    """``50ms`` (or ``0.05s``, ``500us``) as seconds.

    Raises:
        ValueError: For a delay in another form, naming it.
    """
    low = text.strip().lower()
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if low.endswith(unit):
            try:
                value = float(low[: -len(unit)]) * scale
            except ValueError:
                break
            if value >= 0:
                return value
    raise ValueError(f"delay {text!r}: give a number >= 0 with us, ms or s (50ms)")


def open_tap(name: str) -> int:
    """A new TAP device ``name`` in this namespace and the descriptor that carries its frames."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class _Direction:
    """One way of the link: its frames in flight, when the wire is next free, what it sent."""

    def __init__(self, out_fd: int) -> None:
        self.out_fd = out_fd
        self.flight: collections.deque[tuple[float, bytes]] = collections.deque()
        self.free_at = 0.0
        self.sent = 0
        self.dropped = 0


class DelayForwarder:
    """Carries frames between two TAP descriptors at ``rate`` with ``delay`` each way.

    Args:
        fd_a: Host A's TAP descriptor.
        fd_b: Host B's TAP descriptor.
        rate: Bits a second each way (None: no serialisation, only the delay).
        delay: One-way latency in seconds.
        limit: Frames in flight a direction holds; more are dropped.
    """

    def __init__(self, fd_a: int, fd_b: int, rate: float | None, delay: float,
                 limit: int = DEFAULT_LIMIT) -> None:
        self.rate = rate
        self.delay = delay
        self.limit = limit
        self._ways = {fd_a: _Direction(fd_b), fd_b: _Direction(fd_a)}
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="slowlink", daemon=True)

    def start(self) -> DelayForwarder:
        """Start carrying frames (a daemon thread)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop carrying frames and wait for the thread; idempotent."""
        if not self._stop:
            self._stop = True
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def counts(self) -> tuple[int, int, int]:
        """Bytes delivered A to B, B to A, and frames dropped in both ways, so far."""
        a, b = self._ways.values()
        return a.sent, b.sent, a.dropped + b.dropped

    def _admit(self, way: _Direction, frame: bytes, now: float) -> None:
        if len(way.flight) >= self.limit:
            way.dropped += 1
            return
        start = max(now, way.free_at)
        way.free_at = start + (len(frame) * 8 / self.rate if self.rate else 0.0)
        way.flight.append((way.free_at + self.delay, frame))  # FIFO: arrivals in order

    def _run(self) -> None:
        fds = [*self._ways, self._wake_r]
        while not self._stop:
            due = [w.flight[0][0] for w in self._ways.values() if w.flight]
            timeout = max(0.0, min(due) - time.monotonic()) if due else None
            ready, _, _ = select.select(fds, [], [], timeout)
            now = time.monotonic()
            for fd in ready:
                if fd == self._wake_r or self._stop:
                    continue
                try:
                    frame = os.read(fd, 65536)
                except OSError:  # the device went with its namespace
                    return
                self._admit(self._ways[fd], frame, now)
            for way in self._ways.values():
                while way.flight and way.flight[0][0] <= now:
                    _, frame = way.flight.popleft()
                    try:
                        os.write(way.out_fd, frame)
                    except OSError:
                        return
                    way.sent += len(frame)


__all__ = ["DEFAULT_LIMIT", "DelayForwarder", "open_tap", "parse_delay", "parse_rate"]
