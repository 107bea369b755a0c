"""The user-space slow link (benchmarks/_common/slowlink.py), held to what a link does.

The forwarder carries frames between any two message descriptors: with a socket pair per
host in place of the TAP devices, its timing is checked without root. The last test joins
two emulated hosts by it (root and Open MPI's tools, else skipped) and times TCP across.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from benchmarks._common.netns import TwoHosts, available
from benchmarks._common.slowlink import DelayForwarder, parse_delay, parse_rate

FRAME = 1250  # bytes: 1 ms at 10 Mbit/s


def test_rates_and_delays_in_tcs_units():
    assert parse_rate("10mbit") == 10e6 and parse_rate("1gbit") == 1e9
    assert parse_rate("300kbit") == 300e3 and parse_rate("64bit") == 64
    assert parse_delay("50ms") == pytest.approx(0.05) and parse_delay("0.2s") == 0.2
    assert parse_delay("500us") == pytest.approx(5e-4) and parse_delay("0ms") == 0
    for bad in ("10", "fast", "-1mbit", "0mbit", "10mb"):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)
    for bad in ("50", "-1ms", "soon"):
        with pytest.raises(ValueError, match="delay"):
            parse_delay(bad)


@pytest.fixture
def hosts():
    """Two ends of a forwarder: each host's socket (a SEQPACKET pair stands in for a TAP)."""
    a_host, a_link = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b_host, b_link = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    made: list[DelayForwarder] = []

    def link(rate: float | None, delay: float, limit: int = 1000) -> tuple[socket.socket, ...]:
        made.append(DelayForwarder(a_link.fileno(), b_link.fileno(), rate, delay,
                                   limit).start())
        return a_host, b_host

    yield link
    for fwd in made:
        fwd.stop()
    for s in (a_host, a_link, b_host, b_link):
        s.close()


def _arrivals(sock: socket.socket, count: int, timeout: float = 10) -> list[float]:
    sock.settimeout(timeout)
    return [(sock.recv(65536), time.monotonic())[1] for _ in range(count)]


def test_a_frame_arrives_after_the_delay_and_whole(hosts):
    a, b = hosts(None, 0.05)
    frame = bytes(range(256)) * 4
    sent = time.monotonic()
    a.send(frame)
    b.settimeout(5)
    assert b.recv(65536) == frame
    took = time.monotonic() - sent
    assert 0.05 <= took < 0.5  # never early; late only by this machine's scheduling
    b.send(b"back")  # and the other way
    a.settimeout(5)
    assert a.recv(100) == b"back"


def test_frames_leave_at_the_rate_one_after_another_in_order(hosts):
    """100 frames of 1 ms each at 10 Mbit/s: the last arrives ~100 ms after the first was
    sent plus the delay, in the order sent (a link serialises; it does not reorder)."""
    a, b = hosts(10e6, 0.02)
    sent = time.monotonic()
    for i in range(100):
        a.send(i.to_bytes(2, "big") * (FRAME // 2))
    b.settimeout(10)
    got = [b.recv(65536) for _ in range(100)]
    last = time.monotonic() - sent
    assert [int.from_bytes(g[:2], "big") for g in got] == list(range(100))
    assert last >= 0.02 + 100 * 0.001 - 1e-3
    assert last < 1.0


def test_a_full_queue_drops_what_it_cannot_hold(hosts):
    a, b = hosts(10e6, 0.05, limit=10)
    for _ in range(30):  # sent at once: 10 fit, 20 are dropped
        a.send(b"x" * FRAME)
    time.sleep(0.3)
    b.setblocking(False)
    arrived = 0
    while True:
        try:
            b.recv(65536)
        except BlockingIOError:
            break
        arrived += 1
    assert arrived == 10


def test_two_hosts_joined_by_it_see_the_round_trip_and_the_rate():
    ok, why = available()
    if not ok:
        pytest.skip(why)
    probe = (
        "import socket,sys,time\n"
        "s=socket.create_connection((sys.argv[1],5555),timeout=20)\n"
        "rtt=[]\n"
        "for _ in range(3):\n"
        "    t=time.monotonic(); s.sendall(b'x'); s.recv(1); rtt.append(time.monotonic()-t)\n"
        "t=time.monotonic(); s.sendall(b'y'*1250000); s.recv(1)\n"
        "print(min(rtt), time.monotonic()-t)\n")
    serve = (
        "import socket\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind(('0.0.0.0',5555)); s.listen(1); c,_=s.accept()\n"
        "for _ in range(3): c.sendall(c.recv(1))\n"
        "n=0\n"
        "while n<1250000: n+=len(c.recv(65536))\n"
        "c.sendall(b'k')\n")
    with TwoHosts(rate="10mbit", delay="25ms", link="tap") as two:
        server = subprocess.Popen(["ip", "netns", "exec", two.namespaces[1], sys.executable,
                                   "-c", serve])
        try:
            time.sleep(1)
            out = subprocess.run(["ip", "netns", "exec", two.namespaces[0], sys.executable,
                                  "-c", probe, two.addresses[1]], capture_output=True,
                                 text=True, timeout=60)
        finally:
            server.kill()
            server.wait()
        assert out.returncode == 0, out.stderr
        rtt, bulk = map(float, out.stdout.split())
        sent_a, _ = two.link_bytes()
    assert 0.05 <= rtt < 0.2  # 25 ms each way
    assert bulk >= 1.0  # 10 Mbit of payload cannot cross 10 Mbit/s in under a second
    assert sent_a >= 1_250_000  # the link's own count holds the payload and its headers
