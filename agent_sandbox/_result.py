"""What one call returns: `RunResult`, with its error and images, and how events build it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from agent_sandbox._denial import Denial

__all__ = ["Image", "RunError", "RunResult", "ResultBuilder"]


@dataclasses.dataclass(frozen=True)
class RunError:
    """Why a call did not complete normally.

    `kind` is one of `exception` (the user's code raised), `syntax` (it does not parse),
    `denied` (a policy refusal escaped the code), `limit` (a limit ended the call),
    `crashed` (the worker died), `internal` (agent_sandbox itself failed).
    `rule` is set for `denied`, `limit` and `crashed`.
    """

    kind: str
    type: str
    message: str
    traceback: str = ""
    rule: str | None = None
    line: int | None = None
    column: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Image:
    """An image the code produced (a matplotlib figure or a PNG written to scratch)."""

    name: str
    mime: str
    data_base64: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mime": self.mime, "data": self.data_base64}


@dataclasses.dataclass(frozen=True)
class RunResult:
    """The outcome of one call: output, value, error, denials, timings and worker identity.

    `value` is JSON-safe data (objects that are not become `{"__repr__", "__type__"}`).
    `ok` is true when the code completed and nothing was denied. `state_lost` says that the
    session's previous worker died and this call ran in a fresh interpreter.
    """

    stdout: str = ""
    stderr: str = ""
    value: Any = None
    error: RunError | None = None
    denials: tuple[Denial, ...] = ()
    duration: float = 0.0
    worker_id: str = ""
    session: str | None = None
    policy: str = ""
    fingerprint: str = ""
    provider: str = ""
    state_lost: bool = False
    notices: tuple[str, ...] = ()
    images: tuple[Image, ...] = ()
    files: tuple[dict[str, Any], ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None and not self.denials

    @property
    def denied(self) -> bool:
        """Whether any policy refusal happened (even one the code caught)."""
        return bool(self.denials)

    def rules(self) -> list[str]:
        """The distinct rule names of the denials, in order of first appearance."""
        seen: dict[str, None] = {}
        for d in self.denials:
            seen.setdefault(d.rule, None)
        if self.error is not None and self.error.rule:
            seen.setdefault(self.error.rule, None)
        return list(seen)

    def to_dict(self, *, images: bool = True) -> dict[str, Any]:
        """A JSON-safe dict (the `--json` output and the adapters' artifact)."""
        return {
            "ok": self.ok,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "value": self.value,
            "error": self.error.to_dict() if self.error else None,
            "denials": [d.to_dict() for d in self.denials],
            "duration": round(self.duration, 6),
            "worker_id": self.worker_id,
            "session": self.session,
            "policy": self.policy,
            "fingerprint": self.fingerprint,
            "provider": self.provider,
            "state_lost": self.state_lost,
            "notices": list(self.notices),
            "images": [i.to_dict() for i in self.images] if images else [i.name for i in self.images],
            "files": list(self.files),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    def value_text(self) -> str:
        """The value as a model should read it: a repr-like text, empty when None."""
        if self.value is None:
            return ""
        if isinstance(self.value, dict) and set(self.value) == {"__repr__", "__type__"}:
            return str(self.value["__repr__"])
        if isinstance(self.value, str):
            return repr(self.value)
        return json.dumps(self.value, ensure_ascii=False)


class ResultBuilder:
    """Accumulates events from the worker into a `RunResult` (and forwards them live)."""

    def __init__(self) -> None:
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.value: Any = None
        self.error: RunError | None = None
        self.denials: list[Denial] = []
        self.images: list[Image] = []
        self.files: list[dict[str, Any]] = []
        self.notices: list[str] = []
        self.done = False
        self.discard = False

    def add(self, kind: str, data: Any) -> None:
        if kind == "stdout" and isinstance(data, str):
            self.stdout.append(data)
        elif kind == "stderr" and isinstance(data, str):
            self.stderr.append(data)
        elif kind == "denial" and isinstance(data, dict):
            self.denials.append(Denial.from_dict(data))
        elif kind == "result" and isinstance(data, dict):
            self.value = data.get("value")
        elif kind == "error" and isinstance(data, dict):
            self.error = error_from_wire(data)
        elif kind == "image" and isinstance(data, dict):
            self.images.append(
                Image(str(data.get("name", "")), str(data.get("mime", "")), str(data.get("data", "")))
            )
        elif kind == "files" and isinstance(data, list):
            self.files = [f for f in data if isinstance(f, dict)]
        elif kind == "notice" and isinstance(data, str):
            self.notices.append(data)
        elif kind == "done":
            self.done = True
            if isinstance(data, dict):
                self.discard = bool(data.get("discard"))

    def build(self, **fields: Any) -> RunResult:
        return RunResult(
            stdout="".join(self.stdout),
            stderr="".join(self.stderr),
            value=self.value,
            error=self.error,
            denials=tuple(self.denials),
            images=tuple(self.images),
            files=tuple(self.files),
            notices=tuple(self.notices) + tuple(fields.pop("notices", ())),
            **fields,
        )


def error_from_wire(data: dict[str, Any]) -> RunError:
    """Build a RunError from the worker's `error` event, tolerating missing fields."""

    def opt_int(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    rule = data.get("rule")
    return RunError(
        kind=str(data.get("kind", "exception")),
        type=str(data.get("type", "Exception")),
        message=str(data.get("message", "")),
        traceback=str(data.get("traceback", "")),
        rule=str(rule) if rule else None,
        line=opt_int(data.get("line")),
        column=opt_int(data.get("column")),
    )
