"""The operator's refusal log: every refusal of every call, as JSON lines (off by default).

One setting turns it on, for the whole process: `agent_sandbox.log_refusals(target)` where
`target` is a file path (JSON lines appended), a `logging.Logger` (one record per refusal at
INFO, the JSON line as the message, the fields also in `record.sandbox`), or None (off). The
environment variable `AGENT_SANDBOX_REFUSAL_LOG` sets a file path the same way before the
first call. Each line holds: `time`, `policy`, `fingerprint`, `session`, `tool`, `worker_id`,
`provider`, `rule`, `action`, `target`, `classification` (`user`, `internal`, `learned`),
`origin` (`call`, `between-calls`), `count`, `detail`, `hint`, `outcome` (the call's error
kind, or `ok`). Every call of every `Sandbox` (the adapters' tools, the CLI, `sandboxed()`)
goes through it. Lines are JSON with non-ASCII escaped: no control character or terminal
escape reaches the file raw.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from agent_sandbox._host.hostfile import open_append, worker_writable
from agent_sandbox._host.result import RunResult

__all__ = ["log_refusals", "write"]

_ENV = "AGENT_SANDBOX_REFUSAL_LOG"
_lock = threading.Lock()
_target: str | logging.Logger | None = None
_from_env = False


def log_refusals(target: str | os.PathLike[str] | logging.Logger | None) -> None:
    """Send every refusal of every call to `target` (a path or a Logger); None turns it off."""
    global _target, _from_env
    with _lock:
        if target is None or isinstance(target, logging.Logger):
            _target = target
        else:
            _target = os.fspath(target)
        _from_env = True  # an explicit setting wins over the environment


def _current() -> str | logging.Logger | None:
    global _target, _from_env
    if not _from_env:
        with _lock:
            if not _from_env:
                _from_env = True
                path = os.environ.get(_ENV, "")
                if path:
                    _target = path
    return _target


def records(result: RunResult, tool: str = "") -> list[dict[str, Any]]:
    """The log lines (as dicts) of one call's refusals."""
    outcome = result.error.kind if result.error is not None else "ok"
    now = time.time()
    return [
        {
            "time": round(now, 3),
            "policy": result.policy,
            "fingerprint": result.fingerprint,
            "session": result.session,
            "tool": tool,
            "worker_id": result.worker_id,
            "provider": result.provider,
            "rule": d.rule,
            "action": d.action,
            "target": d.target,
            "classification": d.classification,
            "origin": d.origin,
            "count": d.count,
            "detail": d.detail,
            "hint": d.hint,
            "outcome": outcome,
        }
        for d in result.denials
    ]


def write(result: RunResult, tool: str = "", policy: Any = None) -> None:
    """Log `result`'s refusals when the log is on; never raises into the call.

    The file is opened by `hostfile.open_append`: never through a link, never a FIFO or a
    hard link, never where a worker under `policy` (or any worker's scratch) can write."""
    target = _current()
    if target is None or not result.denials:
        return
    try:
        recs = records(result, tool)
        lines = [json.dumps(r, ensure_ascii=True, sort_keys=True) for r in recs]
        if isinstance(target, logging.Logger):
            for line, rec in zip(lines, recs, strict=True):
                target.info(line, extra={"sandbox": rec})
            return
        with _lock:
            fd = open_append(target, writable=worker_writable(policy))
            try:
                os.write(fd, ("\n".join(lines) + "\n").encode("ascii"))
            finally:
                os.close(fd)
    except Exception:
        logging.getLogger("agent_sandbox").warning(
            "could not write the refusal log to %r", target, exc_info=True
        )
