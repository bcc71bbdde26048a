"""The worker's side of host tools: `_host_tool(name, args, kwargs)` in the code's namespace.

A call sends a `host_call` event on the call's own connection and blocks for the host's reply,
one frame (`<length>\\n<json object>`) the host writes on the same connection
(`agent_sandbox._host.intake.transport`, judged by `agent_sandbox._host.hosttools`). The host
decides: it runs the tool only when the policy's `tools.allow` lists it, within
`tools.timeout_seconds`. A refusal is raised in the code as `CallDenied` (a PermissionError)
and recorded like any refusal; a tool's own failure as a RuntimeError.

Standard library only (with the shared modules); runs in the worker, during a call.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading

from agent_sandbox._denial import Denial
from agent_sandbox._errors import CallDenied
from agent_sandbox._worker import audit

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["host_tool_caller"]

#: The largest reply the worker reads (the host keeps its replies well below it).
_MAX_REPLY = 16 * 1024 * 1024


def host_tool_caller(
    sock: socket.socket, put: Any, owner: int, policy_name: str, policy: dict[str, Any]
) -> Any:
    """`_host_tool(name, args, kwargs)` for this call's code: a request to the host on
    the call's own connection (a `host_call` event), answered by one framed reply the host
    writes on the same connection (`<length>\n<json>`). The host decides: it runs the
    tool only when `tools.allow` lists it, within `tools.timeout_seconds`."""
    calls = [0]
    tool_lock = threading.Lock()
    timeout = float(policy.get("tools", {}).get("timeout_seconds", 30))

    def host_tool(name: str, args: Any = (), kwargs: Any = None) -> Any:
        if os.getpid() != owner:
            raise RuntimeError("host tools are callable from the worker's own process only")
        try:
            payload = json.dumps(
                {"name": str(name), "args": list(args), "kwargs": dict(kwargs or {})}
            )
        except (TypeError, ValueError) as exc:
            raise TypeError(f"a host tool's arguments must be JSON data: {exc}") from None
        with tool_lock:
            calls[0] += 1
            put("host_call", {"id": calls[0], "request": payload})
            reply = _read_frame(sock, timeout + 5.0)
        if reply.get("ok") is True:
            return reply.get("value")
        if "rule" in reply:
            denial = Denial(
                rule=str(reply.get("rule"))[:40],
                action="call",
                target=str(name)[:100],
                policy=policy_name,
                hint=str(reply.get("hint", ""))[:500],
                detail=str(reply.get("detail", ""))[:1000],
            )
            refusal = CallDenied(denial)
            audit.record_raised(denial, refusal)
            raise refusal
        raise RuntimeError(f"host tool {name!r} failed: {str(reply.get('error'))[:2000]}")

    def scratch_metadata(request: dict[str, Any]) -> dict[str, Any]:
        """Ask the host for a chmod or utime in scratch (`guards/_files.py`); the host's
        reply (`{"ok": true}` or an errno and a reason), or a refusal from here."""
        if os.getpid() != owner:
            return {"ok": False, "errno": errno.EPERM, "reason": "not from a forked process"}
        payload = json.dumps({"scratch_metadata": request})
        with tool_lock:
            calls[0] += 1
            put("host_call", {"id": calls[0], "request": payload})
            try:
                reply = _read_frame(sock, 30.0)
            except RuntimeError as exc:
                return {"ok": False, "errno": errno.EPERM, "reason": str(exc)[:200]}
        if reply.get("ok") is not True and "errno" not in reply:
            reason = str(reply.get("error") or reply.get("detail") or "")[:200]
            return {"ok": False, "errno": errno.EPERM, "reason": reason}
        return reply

    host_tool.scratch_metadata = scratch_metadata  # type: ignore[attr-defined]
    return host_tool


def _read_frame(sock: socket.socket, timeout: float) -> dict[str, Any]:
    """One host reply on the call's connection: `<length>\n<json object>` (bounded)."""
    sock.settimeout(timeout)
    try:
        head = b""
        while not head.endswith(b"\n"):
            byte = sock.recv(1)
            if not byte or len(head) > 12:
                raise ConnectionError("the host's tool reply is malformed")
            head += byte
        length = int(head)
        if not 0 <= length <= _MAX_REPLY:
            raise ConnectionError("the host's tool reply is too large")
        body = b""
        while len(body) < length:
            data = sock.recv(min(65536, length - len(body)))
            if not data:
                raise ConnectionError("the host closed the connection")
            body += data
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"no reply from the host for a tool call ({exc})") from None
    finally:
        sock.settimeout(None)
    reply = json.loads(body)
    if not isinstance(reply, dict):
        raise RuntimeError("the host's tool reply is malformed")
    return reply
