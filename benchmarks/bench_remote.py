"""Remote worker benchmark: a warm call over loopback mutual TLS vs the local Unix socket,
the claim of a warm worker, and a bounded loopback load test.

Run: `.venv/bin/python benchmarks/bench_remote.py [--rounds N] [--blocks B] [--load P,T,K]`

All in one run on this machine. The warm call is measured in interleaved blocks (a block of
local calls, then a block of remote calls, B times), so both see the same load; the ratio is
per block, and its median and range are printed. Both workers run the same policy under the
`subprocess` provider (the Python layer only; the transport is what is compared): the local
one is a `WorkerProcess` on its Unix socket (h11), the remote one is `agent-sandbox worker
serve` on 127.0.0.1 with mTLS, reached by `RemoteWorker` (its calls: h11 on its own TLS
socket), which relays to the same kind of worker on its own Unix socket. Targets (issue
21): warm remote call <= 2x the local one; claim of a warm worker through
`LocalClaimBackend` <= 5 ms; zero errors and nothing left behind in the load test.

The load test starts P processes, each with a `LocalClaimBackend` (warm = T) and T threads;
every thread opens its own session (a distinct conversation thread), makes K calls and
closes it. It prints the claim latency (median, max), the calls' latency, the errors
(back-pressure `ClaimCapacityError`s counted apart) and what was left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

from agent_sandbox import Policy
from agent_sandbox._host.intake.remote_transport import RemoteTLS
from agent_sandbox._host.process import WorkerProcess
from agent_sandbox._host.remote.provider import LocalClaimBackend, RemoteProvider, ServerFiles
from agent_sandbox._host.remote.worker import RemoteWorker
from agent_sandbox.providers import get_provider

POLICY = Policy(name="bench-remote", provider="subprocess", no_kernel_boundary="accepted")


def make_certs(folder: str) -> dict[str, str]:
    import trustme

    ca = trustme.CA()
    paths = {"ca": os.path.join(folder, "ca.pem")}
    ca.cert_pem.write_to_path(paths["ca"])
    for name, ident in (("server", "127.0.0.1"), ("client", "bench@agent")):
        path = os.path.join(folder, name + ".pem")
        ca.issue_cert(ident).private_key_and_cert_chain_pem.write_to_path(path)
        paths[name] = path
    return paths


def ms(values: list[float]) -> str:
    return (
        f"median {statistics.median(values) * 1000:7.3f} ms  "
        f"min {min(values) * 1000:7.3f}  max {max(values) * 1000:7.3f}"
    )


def block(fn: object, n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def warm_calls(certs: dict[str, str], rounds: int, blocks: int) -> None:
    secret = secrets.token_hex(16)
    files = ServerFiles(certs["server"], certs["server"], certs["ca"])
    with LocalClaimBackend(files, bind_secret=secret, warm=1, provider="subprocess") as backend:
        claim = backend.claim("ags-bench", 30)
        remote = RemoteWorker.connect(
            POLICY,
            claim.url,
            token=secrets.token_hex(16),
            bind_secret=secret,
            tls=RemoteTLS(ca_file=certs["ca"], client_cert=certs["client"]),
        )
        local = WorkerProcess.start(POLICY, get_provider("subprocess"))
        try:
            for w in (local, remote):
                for _ in range(20):
                    assert w.run("x = 1").ok
            loc, rem, ratio = [], [], []
            for _ in range(blocks):
                a = block(lambda: local.run("x = 1"), rounds)
                b = block(lambda: remote.run("x = 1"), rounds)
                loc.append(a)
                rem.append(b)
                ratio.append(b / a)
            print(f"warm call, local Unix socket (h11)     {ms(loc)}  (block medians)")
            print(f"warm call, loopback mTLS (h11+relay)   {ms(rem)}  (block medians)")
            print(
                f"ratio remote/local per block: median {statistics.median(ratio):.2f}x  "
                f"range {min(ratio):.2f}x..{max(ratio):.2f}x   (target <= 2x)"
            )
        finally:
            local.close()
            remote.close()


def claim_latency(certs: dict[str, str], rounds: int) -> None:
    secret = secrets.token_hex(16)
    files = ServerFiles(certs["server"], certs["server"], certs["ca"])
    n = min(rounds, 10)
    with LocalClaimBackend(
        files, bind_secret=secret, warm=n, max_workers=n, provider="subprocess"
    ) as backend:
        backend.fill()
        claims, bound = [], []
        tls = RemoteTLS(ca_file=certs["ca"], client_cert=certs["client"])
        for i in range(n):
            t0 = time.perf_counter()
            claim = backend.claim(f"ags-claim-{i}", 10)
            t1 = time.perf_counter()
            worker = RemoteWorker.connect(
                POLICY, claim.url, token=secrets.token_hex(16), bind_secret=secret, tls=tls
            )
            t2 = time.perf_counter()
            claims.append(t1 - t0)
            bound.append(t2 - t0)
            worker.close()
            backend.release(claim)
        print(f"claim of a warm worker (LocalClaimBackend) {ms(claims)}  n={n} (target <= 5 ms)")
        print(f"claim + bind + handshake (worker started)  {ms(bound)}  n={n}")


_LOAD_CHILD = r"""
import json, secrets, sys, threading, time
from agent_sandbox import Policy
from agent_sandbox._errors import CapacityError
from agent_sandbox._host.intake.remote_transport import RemoteTLS
from agent_sandbox._host.remote.provider import LocalClaimBackend, RemoteProvider, ServerFiles
ca, server, client = sys.argv[1:4]
threads, calls = int(sys.argv[4]), int(sys.argv[5])
policy = Policy(name="bench-remote", provider="subprocess", no_kernel_boundary="accepted")
secret = secrets.token_hex(16)
out = {"claim": [], "call": [], "errors": [], "capacity": 0}
lock = threading.Lock()
with LocalClaimBackend(ServerFiles(server, server, ca), bind_secret=secret, warm=threads,
                       max_workers=threads, provider="subprocess") as backend:
    backend.fill()
    provider = RemoteProvider(backend, session_key=secrets.token_bytes(32), bind_secret=secret,
                              tls=RemoteTLS(ca_file=ca, client_cert=client), max_claims=threads,
                              claim_timeout=30)
    def work(i):
        try:
            with provider.session(policy, thread=f"t{i}-{secrets.token_hex(4)}") as s:
                t0 = time.perf_counter(); r = s.run("n = 0"); first = time.perf_counter() - t0
                with lock: out["claim"].append(first)
                for _ in range(calls):
                    t0 = time.perf_counter(); r = s.run("n += 1\nn")
                    with lock:
                        out["call"].append(time.perf_counter() - t0)
                        if not r.ok: out["errors"].append(repr(r.error)[:200])
        except CapacityError:
            with lock: out["capacity"] += 1
        except Exception as exc:
            with lock: out["errors"].append(repr(exc)[:200])
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    [t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps(out))
"""


def load_test(certs: dict[str, str], procs: int, threads: int, calls: int) -> dict[str, object]:
    """Run the load test, print its figures, and return them (`tests/remote/test_load.py`
    asserts zero errors and nothing left behind on a small one)."""
    marker = secrets.token_hex(8)  # inherited by this run's `worker serve` processes only
    env = {**os.environ, _MARK: marker}
    argv = [sys.executable, "-c", _LOAD_CHILD, certs["ca"], certs["server"], certs["client"]]
    children = [
        subprocess.Popen(
            [*argv, str(threads), str(calls)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(procs)
    ]
    results = [json.loads(c.communicate(timeout=600)[0]) for c in children]
    claim = [x for r in results for x in r["claim"]]
    call = [x for r in results for x in r["call"]]
    errors = [e for r in results for e in r["errors"]]
    capacity = sum(r["capacity"] for r in results)
    left = _serve_pids(marker)
    for _ in range(20):  # a server sees its parent gone within 0.2 s (`--exit-with-parent`)
        if not left:
            break
        time.sleep(0.25)
        left = _serve_pids(marker)
    print(f"load test: {procs} processes x {threads} threads x {calls} calls")
    if claim:
        print(f"  first call (claim + bind + start + call) {ms(claim)}  n={len(claim)}")
    if call:
        print(f"  warm call under load                     {ms(call)}  n={len(call)}")
    print(
        f"  errors {len(errors)}  back-pressure (CapacityError) {capacity}  "
        f"worker-serve processes left {len(left)}"
    )
    for e in errors[:5]:
        print("   ", e)
    return {
        "claim": claim,
        "call": call,
        "errors": errors,
        "capacity": capacity,
        "left": sorted(left),
        "children": [c.returncode for c in children],
    }


_MARK = "AGENT_SANDBOX_BENCH_RUN"


def _serve_pids(marker: str) -> set[int]:
    """This run's `worker serve` processes still alive (by the marker in their environment:
    other runs on a shared machine are not counted)."""
    pids = set()
    needle = f"{_MARK}={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if b"worker\0serve" not in fh.read():
                        continue
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0"):
                        pids.add(int(entry))
            except OSError:
                pass
    return pids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--load", default="2,3,20", help="processes,threads,calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agent-sandbox-bench-") as folder:
        certs = make_certs(folder)
        print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        warm_calls(certs, args.rounds, args.blocks)
        claim_latency(certs, args.rounds)
        p, t, k = (int(x) for x in args.load.split(","))
        load_test(certs, p, t, k)


if __name__ == "__main__":
    _ = RemoteProvider  # the load test's children use it
    main()
