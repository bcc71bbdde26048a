"""The guard check of `agent-sandbox worker serve`: its worker's guard counter, read in the pod.

On a local host the agent's host reads the worker's arming counter from the worker's memory
before it passes each event on (`_host/intake/guard_block.py`, `evidence.GuardEvidence`).
An agent's host cannot read a remote worker's memory, so the pod's own process, the worker's
parent and outside its sandbox, does the same reading for every event it relays
(`_host/remote/serve.py`), and tells the agent's host by a `guard.tampered` denial on a cut
stream (`RemoteCall._on_lost` withholds the call's output).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CallGuard"]


class CallGuard:
    """The pod's own reading of its worker's guard counter during one call, event by event,
    as the local host's forwarder does (`_host/intake/guard_block.py`): an event read while
    the guards are armed goes on to the host, one read after the disarming is held until
    the call's end is verified, and after tampering nothing more goes on. Only the events'
    kinds are read here (the host judges the rest)."""

    def __init__(self, watch: Any, cap: int) -> None:
        self.watch = watch
        self.cap = cap
        self.buf = bytearray()
        self.scan = 0
        self.held = bytearray()
        self.reason = ""
        self.oversize = False
        watch.begin_call()

    def feed(self, data: bytes) -> bytes:
        """The bytes that may go to the host now (whole events only)."""
        from agent_sandbox._host.intake import guard_block

        if self.oversize:
            return data
        self.buf += data
        out = bytearray()
        while not self.reason:
            end = self.buf.find(b"\n\n", self.scan)
            if end < 0:
                self.scan = max(0, len(self.buf) - 1)
                if len(self.buf) > self.cap:
                    # Larger than any event the host accepts: it goes on as it is, and the
                    # host refuses it (and ends the call); what was held stays withheld.
                    self.oversize = True
                    self.held.clear()
                    out += self.buf
                    self.buf.clear()
                break
            event = bytes(self.buf[: end + 2])
            del self.buf[: end + 2]
            self.scan = 0
            line = event.split(b"\n", 1)[0]
            kind = line[len(b"event: ") :] if line.startswith(b"event: ") else b""
            if kind == b"start":
                out += event  # framing, sent before the call arms (as on the local host)
                continue
            verdict = self.watch.judge(kind.decode("ascii", "replace"))
            if verdict == guard_block.HOLD:
                self.held += event
            elif verdict == guard_block.TAMPERED:
                self.reason = self.watch.reason or "the guards' state"
            else:
                out += self.held
                self.held.clear()
                out += event
        if self.reason:
            self.held.clear()
            self.buf.clear()
        return bytes(out)

    def tamper_event(self, policy: str) -> bytes:
        """What the host gets instead of the rest of the call (it then finds the stream cut
        and withholds the call's output, `RemoteCall._on_lost`)."""
        from agent_sandbox._denial import Denial
        from agent_sandbox._wire import encode_event

        denial = Denial(
            rule="guard.tampered",
            action="tamper",
            target=f"the pod read the worker's guard counter: {self.reason}"[:500],
            policy=policy,
            detail="a guard was disarmed or displaced; this worker will be discarded",
        )
        return encode_event("denial", denial.to_dict())
