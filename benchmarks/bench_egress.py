"""The egress proxy's cost: a request through it against a direct one, and the cold start.

1. Requests, in one run, interleaved, on loopback (a small HTTP/1.1 server in this process):
   * host: `http.client` keep-alive GETs straight to the server, against the same GETs in
     absolute form through the proxy (a listener in this process stands in for a worker's);
     then one new connection per request (`Connection: close`) both ways, then a `CONNECT`
     tunnel set-up (connect, CONNECT, 200) against a plain TCP connect;
   * sandbox (`--provider`, default bwrap): inside a worker, keep-alive GETs through the
     proxy to the host's server, against GETs to a server the worker runs on its own
     loopback (the only direct route a sandbox has).
2. Cold start of a worker to ready with the proxy (a policy with a `[net]` rule) against
   without (no rule), same provider, interleaved.

Prints medians (and min) in milliseconds over repeats, the difference and the ratio; the
targets are under 1 ms added per request on loopback and under 5 ms added per start (judged
on the median of the per-pair differences of the starts, which a loaded machine disturbs
least; the host's CPU time per start is printed beside).

    .venv/bin/python benchmarks/bench_egress.py [--repeats 11] [--requests 200] [--starts 21]
"""

from __future__ import annotations

import argparse
import http.client
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from agent_sandbox import Policy, Sandbox
from agent_sandbox._host.egress.proxy import egress_proxy
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox.providers import get_provider

REQUEST_TARGET_MS = 1.0
START_TARGET_MS = 5.0


_SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        close = self.headers.get("connection", "").lower() == "close"
        extra = b"connection: close\r\n" if close else b""
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n" + extra + b"\r\nok")
        self.close_connection = close
    def log_message(self, *a):
        pass
class S(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
httpd = S(("127.0.0.1", 0), H)
print(httpd.server_address[1], flush=True)
httpd.serve_forever()
"""


class _Server:
    """A small HTTP/1.1 server in its own process (no GIL shared with the client)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _per_request(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1000 / n


def _rounds(fns: dict[str, Callable[[], None]], n: int, repeats: int) -> dict[str, list[float]]:
    for fn in fns.values():
        _per_request(fn, max(n // 10, 5))  # warm
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name].append(_per_request(fn, n))
    return out


def _keepalive(host: str, port: int, target: str) -> Callable[[], None]:
    conn = http.client.HTTPConnection(host, port)

    def get() -> None:
        conn.request("GET", target)
        conn.getresponse().read()

    return get


def _fresh(host: str, port: int, target: str) -> Callable[[], None]:
    def get() -> None:
        conn = http.client.HTTPConnection(host, port)
        conn.request("GET", target, headers={"connection": "close"})
        conn.getresponse().read()
        conn.close()

    return get


def _until_closed(s: socket.socket) -> None:
    """Half-close and wait for the peer's close, so no connection outlives its round."""
    s.shutdown(socket.SHUT_WR)
    while s.recv(4096):
        pass


def _tunnel(proxy_port: int, server_port: int) -> Callable[[], None]:
    def setup() -> None:
        with socket.create_connection(("127.0.0.1", proxy_port)) as s:
            s.sendall(f"CONNECT 127.0.0.1:{server_port} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            assert s.recv(64).startswith(b"HTTP/1.1 200")
            _until_closed(s)

    return setup


def _plain_connect(server_port: int) -> Callable[[], None]:
    def setup() -> None:
        with socket.create_connection(("127.0.0.1", server_port)) as s:
            _until_closed(s)

    return setup


def _report(title: str, rows: dict[str, list[float]], pairs: list[tuple[str, str]]) -> None:
    print(f"\n{title} (ms per request, median / min over {len(next(iter(rows.values())))})")
    for name, values in rows.items():
        print(f"  {name:<44} {statistics.median(values):7.3f} / {min(values):7.3f}")
    for via, direct in pairs:
        a, b = statistics.median(rows[via]), statistics.median(rows[direct])
        verdict = "meets" if a - b < REQUEST_TARGET_MS else "misses"
        print(
            f"  added by the proxy ({via} vs {direct}): {a - b:+.3f} ms, ratio {a / b:.2f}x "
            f"({verdict} < {REQUEST_TARGET_MS:g} ms)"
        )


def bench_host(n: int, repeats: int) -> None:
    server = _Server()
    port = server.port
    policy = Policy(name="bench", net={"rules": [{"host": "127.0.0.1", "ports": str(port)}]})
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    proxy_port = listener.getsockname()[1]
    route = egress_proxy().attach(policy, listener)
    url = f"http://127.0.0.1:{port}/"
    try:
        rows = _rounds(
            {
                "direct, keep-alive": _keepalive("127.0.0.1", port, "/"),
                "through the proxy, keep-alive": _keepalive("127.0.0.1", proxy_port, url),
                "direct, new connection": _fresh("127.0.0.1", port, "/"),
                "through the proxy, new connection": _fresh("127.0.0.1", proxy_port, url),
                "TCP connect and close": _plain_connect(port),
                "CONNECT tunnel set-up and close": _tunnel(proxy_port, port),
            },
            n,
            repeats,
        )
    finally:
        route.close()
        server.close()
    _report(
        "host: http.client on loopback, client and proxy in this process",
        rows,
        [
            ("through the proxy, keep-alive", "direct, keep-alive"),
            ("through the proxy, new connection", "direct, new connection"),
            ("CONNECT tunnel set-up and close", "TCP connect and close"),
        ],
    )


_SANDBOX_CODE = """
import http.client, time
via = http.client.HTTPConnection("127.0.0.1", 3128)
def per(conn, target, n):
    t0 = time.perf_counter()
    for _ in range(n):
        conn.request("GET", target)
        conn.getresponse().read()
    return (time.perf_counter() - t0) * 1000 / n
per(via, URL, 20)
[per(via, URL, N) for _ in range(REPEATS)]
"""


def bench_sandbox(provider: str, n: int, repeats: int) -> None:
    """Keep-alive GETs from inside a worker through the proxy, against the same GETs from
    this process straight to the same server (a sandbox has no direct route to compare)."""
    server = _Server()
    port = server.port
    policy = Policy(
        name="bench",
        imports={"allow": ["http", "time"]},
        net={"rules": [{"host": "127.0.0.1", "ports": str(port)}]},
        limits={"wall_seconds": 600},
    )
    code = (
        _SANDBOX_CODE.replace("URL", repr(f"http://127.0.0.1:{port}/"))
        .replace("REPEATS", "1")
        .replace("N)", f"{n})")
    )
    direct = _keepalive("127.0.0.1", port, "/")
    try:
        with Sandbox(policy, provider=provider, warm=0) as sb:
            session = sb.session("bench")
            session.run("1")
            via: list[float] = []
            straight: list[float] = []
            _per_request(direct, 20)
            for _ in range(repeats):  # interleaved: one repeat each way at a time
                result = session.run(code, timeout=600)
                if result.error is not None:
                    print(f"\nsandbox ({provider}): failed: {result.error.message}")
                    return
                via.extend(result.value)
                straight.append(_per_request(direct, n))
    finally:
        server.close()
    rows = {
        "worker, through the proxy, keep-alive": via,
        "this process, direct, keep-alive": straight,
    }
    _report(
        f"sandbox ({provider}): http.client GETs to a server in its own process",
        rows,
        [("worker, through the proxy, keep-alive", "this process, direct, keep-alive")],
    )


def bench_start(provider: str, runs: int) -> None:
    """Starts with and without the proxy in pairs, the order alternating within a pair;
    besides the medians, the median of the per-pair differences (a loaded machine moves
    both starts of a pair alike) and the host's CPU time per start (all its threads)."""
    with_net = Policy(name="bench", net={"rules": [{"host": "127.0.0.1", "ports": "80"}]})
    without = Policy(name="bench")
    prov = get_provider(provider)
    names = ("without the proxy", "with the proxy")
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    policies = {"without the proxy": without, "with the proxy": with_net}
    for policy in policies.values():
        WorkerProcess.start(policy, prov).close()  # warm
    for i in range(runs):
        for name in names if i % 2 == 0 else names[::-1]:
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            w = WorkerProcess.start(policies[name], prov)
            times[name].append((time.perf_counter() - t0) * 1000)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu[name].append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1000)
            w.close()
    print(f"\ncold start to ready ({provider}, ms, median / min over {runs})")
    for name, values in times.items():
        print(
            f"  {name:<44} {statistics.median(values):7.1f} / {min(values):7.1f}"
            f"   (host CPU {statistics.median(cpu[name]):5.1f})"
        )
    a = statistics.median(times["with the proxy"])
    b = statistics.median(times["without the proxy"])
    pairs = [
        x - y for x, y in zip(times["with the proxy"], times["without the proxy"], strict=True)
    ]
    paired = statistics.median(pairs)
    quartiles = statistics.quantiles(pairs, n=4)
    verdict = "meets" if paired < START_TARGET_MS else "misses"
    print(
        f"  added by the proxy: {a - b:+.1f} ms between the medians, ratio {a / b:.2f}x; "
        f"{paired:+.1f} ms median of the pairs (quartiles {quartiles[0]:+.1f} / "
        f"{quartiles[2]:+.1f}) ({verdict} < {START_TARGET_MS:g} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--starts", type=int, default=31)
    parser.add_argument("--provider", action="append", default=None)
    args = parser.parse_args()
    providers = args.provider or ["bwrap", "unshare"]
    providers = [p for p in providers if get_provider(p).probe().available]
    bench_host(args.requests, args.repeats)
    for provider in providers:
        bench_sandbox(provider, args.requests, args.repeats)
    for provider in providers:
        bench_start(provider, args.starts)


if __name__ == "__main__":
    main()
