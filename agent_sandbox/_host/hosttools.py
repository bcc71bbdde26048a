"""Host tools: functions of the agent's process that the sandboxed code may call.

An agent framework's tools (a web search, a database query, another agent) run in the host
process, with the host's credentials; the code in the worker gets a stub that sends a request
over the call's own connection (a `host_call` event) and blocks for the host's framed reply
(`agent_sandbox._worker.server`, `agent_sandbox._host.intake.transport`). This module is the
host's judge of those requests:

* the request is data: a JSON object with a string `name`, a list `args` and an object
  `kwargs`, at most `HOST_CALL_BYTES` (the transport's cap);
* a name `tools.allow` does not list is refused (rule `tools`), whatever the code registered;
* a listed tool runs in a thread of its own; one that does not return within
  `tools.timeout_seconds` is refused (rule `tools.timeout`) and the code goes on (the thread
  cannot be killed: it is left to finish, and its result is dropped); the host never waits
  past the call's own deadline (`limits.wall_seconds`): the call then ends as a timeout;
* what the tool returns goes back as JSON (a value JSON cannot carry is sent as its `str`),
  at most `MAX_REPLY_BYTES`; an exception goes back as its type and message.

Each refusal reaches the code as a `CallDenied` (a PermissionError) whose denial the worker
records, so it is in the call's result and trace like any other refusal.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agent_sandbox._hints import grant_hint

if TYPE_CHECKING:
    from agent_sandbox.policies import Policy

__all__ = ["MAX_REPLY_BYTES", "make_handler"]

#: The largest reply (a tool's JSON result) sent back to the code.
MAX_REPLY_BYTES = 4_000_000


def make_handler(
    policy: Policy, tools: Mapping[str, Callable[..., Any]]
) -> Callable[[Any, float], dict[str, Any]]:
    """The answer to each host-tool request of one call, judged by `policy.tools`."""
    allowed = frozenset(policy.tools.allow)
    timeout = float(policy.tools.timeout_seconds)

    def handle(data: Any, remaining: float) -> dict[str, Any]:
        """`remaining`: seconds before the call's own deadline (`limits.wall_seconds`)."""
        request = _request(data)
        if request is None:
            return {"ok": False, "error": "a malformed host-tool request"}
        name, args, kwargs = request
        if name not in allowed:
            return {
                "ok": False,
                "rule": "tools",
                "detail": "the tool is not in [tools] allow",
                "hint": grant_hint({"tools.allow": [name]}),
            }
        fn = tools.get(name)
        if fn is None:
            return {"ok": False, "error": f"no host tool named {name!r} is served in this call"}
        if remaining < timeout:
            # The call's wall time ends first: waited for until then, and the call ends
            # there as a timeout (`limits.timeout`), whatever the tool does.
            return _call(fn, name, args, kwargs, remaining, by_deadline=True)
        return _call(fn, name, args, kwargs, timeout)

    return handle


def _request(data: Any) -> tuple[str, list[Any], dict[str, Any]] | None:
    if not isinstance(data, dict) or not isinstance(data.get("request"), str):
        return None
    try:
        request = json.loads(data["request"])
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    name, args, kwargs = request.get("name"), request.get("args"), request.get("kwargs")
    if not (isinstance(name, str) and name.isidentifier() and len(name) <= 100):
        return None
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return None
    if not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        return None
    return name, args, kwargs


def _call(
    fn: Callable[..., Any],
    name: str,
    args: list[Any],
    kwargs: dict[str, Any],
    timeout: float,
    *,
    by_deadline: bool = False,
) -> dict[str, Any]:
    box: dict[str, Any] = {}
    done = threading.Event()

    def body() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # reported to the code, never raised here
            box["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            done.set()

    threading.Thread(target=body, name=f"host-tool-{name}", daemon=True).start()
    if not done.wait(timeout):
        if by_deadline:
            return {"ok": False, "error": "the call's wall time ran out while the tool ran"}
        return {
            "ok": False,
            "rule": "tools.timeout",
            "detail": f"the tool did not return within {timeout:g} s ([tools] timeout_seconds)",
            "hint": grant_hint({"tools.timeout_seconds": timeout * 2}),
        }
    if "error" in box:
        return {"ok": False, "error": box["error"][:2000]}
    try:
        text = json.dumps(box.get("value"), default=str)
    except (TypeError, ValueError) as exc:
        return {"ok": False, "error": f"the tool's result cannot be sent as JSON ({exc})"}
    if len(text) > MAX_REPLY_BYTES:
        return {
            "ok": False,
            "error": f"the tool's result is {len(text)} bytes as JSON, more than {MAX_REPLY_BYTES}",
        }
    return {"ok": True, "value": json.loads(text)}
