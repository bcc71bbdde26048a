"""`/proc/<pid>/mem` token theft: hostile code reads another session's worker from /proc.

The attacker is native code (ctypes, with the Python guards stepped aside by the hostile
policy) in one worker; the victim is the worker of another session of another sandbox. The
attack reads the victim's `/proc/<pid>/maps` and then its memory through `/proc/<pid>/mem`,
looking for the victim's bearer token (with it, the attacker could run code in the victim's
interpreter). The verdict is the attack's own report: bytes read from the victim and whether
the token was among them. Under the default (`auto`) and each kernel provider nothing of the
victim's memory may be read; under the explicit `subprocess` opt-out (no kernel boundary) it
is expected to succeed, which the strict xfail pins.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox

from .conftest import (
    KERNEL_PROVIDERS,
    NATIVE,
    accepted_for,
    hostile_policy,
    skip_unless_available,
)

_ATTACK = r"""
_libc.pread.restype = ctypes.c_ssize_t
_libc.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
token = TOKEN.encode()
found, read_bytes, errors = False, 0, []
buf = ctypes.create_string_buffer(1 << 20)
for pid in PIDS:
    maps = nread(f"/proc/{pid}/maps")
    if isinstance(maps, int) or not maps:
        errors.append(["maps", pid, maps])
    fd = nopen(f"/proc/{pid}/mem")
    if fd < 0:
        errors.append(["mem", pid, fd])
        continue
    regions = []
    for line in (maps if isinstance(maps, str) else "").splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if "r" in perms and hi - lo <= (256 << 20):
            regions.append((lo, hi))
    for lo, hi in regions:
        off = lo
        while off < hi:
            n = _libc.pread(fd, buf, min(1 << 20, hi - off), off)
            if n <= 0:
                break
            read_bytes += n
            # Overlap chunks by the token's length so a token across a boundary is found.
            if token in buf.raw[:n]:
                found = True
            off += max(n - len(token), 1) if n == (1 << 20) else n
    _libc.close(fd)
print("ATTACK " + json.dumps({"found": found, "read": read_bytes, "errors": errors[:8]}))
"""


def _descendants(root: int) -> list[int]:
    """`root` and every process below it (host pids), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _attack(provider: str, arena: dict[str, Path]) -> dict[str, Any]:
    victim_policy = Policy(name="victim", imports={"allow": ["math"]}, **accepted_for(provider))
    attacker_policy = hostile_policy(arena)
    if provider == "subprocess":
        victim_policy = victim_policy.model_copy(update={"no_kernel_boundary": "accepted"})
        attacker_policy = attacker_policy.model_copy(update={"no_kernel_boundary": "accepted"})
    with (
        Sandbox(victim_policy, provider=provider, warm=0) as victims,
        Sandbox(attacker_policy, provider=provider, warm=0) as attackers,
    ):
        victim = victims.session("victim")
        assert victim.run("x = 1").ok
        assert victim.worker is not None
        pids = _descendants(victim.worker.pid)
        code = (
            NATIVE
            + "import json\n"
            + f"TOKEN = {victim.worker.token!r}\nPIDS = {pids!r}\n"
            + _ATTACK
        )
        result = attackers.session("attacker").run(code)
        assert victim.run("x").value == 1  # the victim is still alive and its own
    lines = [line for line in result.stdout.splitlines() if line.startswith("ATTACK ")]
    assert lines, (result.stdout, result.stderr, result.error)  # the attack itself ran
    report: dict[str, Any] = json.loads(lines[-1].removeprefix("ATTACK "))
    return report


@pytest.mark.parametrize("provider", ["auto", *KERNEL_PROVIDERS])
def test_proc_pid_mem_token_theft(provider: str, arena: dict[str, Path]) -> None:
    """It keeps a hostile worker from reading another session's worker memory (and so its
    token) through /proc/<pid>/mem, under the default and under each kernel provider."""
    skip_unless_available(provider)
    report = _attack(provider, arena)
    assert report["found"] is False, report
    assert report["read"] == 0, report


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="the explicit `subprocess` opt-out has no kernel boundary: a worker running as "
    "the same user may read a sibling worker's memory through /proc/<pid>/mem; only a "
    "kernel provider (the default, `auto`) stops it",
)
def test_proc_pid_mem_token_theft_under_the_subprocess_opt_out(arena: dict[str, Path]) -> None:
    """Under the opt-out, the same attack is expected to read the victim's token."""
    report = _attack("subprocess", arena)
    assert report["found"] is False, report
