"""Every exception agent_sandbox raises, in one place.

The tree, host side first (what the agent's process may see), then the denials raised
inside the worker while user code runs:

* SandboxError                      - base of everything below
  * PolicyError (ValueError)        - a policy is malformed; names file, key, line, expected
    * PolicyNotFound (FileNotFoundError) - the policy file or preset does not exist
  * ProviderUnavailable             - a requested OS provider cannot run on this machine
  * WorkerError                     - the worker process misbehaved
    * WorkerStartError              - the worker did not become ready
    * WorkerCrashed                 - the worker died while a call ran
  * TransportError                  - the parent/worker channel broke or sent garbage
    * MessageTooLarge               - one event or a result exceeded its cap
    * UnpickleRefused               - the host's restricted unpickler refused a payload
  * ChildException                  - stand-in for a worker exception the host cannot rebuild
  * SandboxClosed                   - the sandbox or session was closed
  * CapacityError                   - every session slot stayed busy for the whole wait
  * LearningError                   - a learning proposal could not be made, written or applied
  * SandboxDenied                   - a policy refused an operation (carries a Denial)
    * FileAccessDenied (PermissionError)
    * HiddenPathDenied (FileNotFoundError)
    * NetworkDenied (ConnectionRefusedError)
    * ImportDenied (ModuleNotFoundError)
    * EnvDenied (KeyError)
    * CallDenied (PermissionError)
    * CodeRejected (SyntaxError)
    * AttributeDenied (AttributeError)
    * LimitExceeded                 - a budget or resource limit was hit

This module is imported by the worker before anything else, so it uses the standard
library only.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Sequence

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

    from agent_sandbox._denial import Denial

__all__ = [
    "AttributeDenied",
    "CallDenied",
    "CapacityError",
    "ChildException",
    "CodeRejected",
    "EnvDenied",
    "FileAccessDenied",
    "FileTransferRefused",
    "HiddenPathDenied",
    "ImportDenied",
    "LearningError",
    "LimitExceeded",
    "MessageTooLarge",
    "NetworkDenied",
    "PolicyError",
    "PolicyNotFound",
    "ProviderUnavailable",
    "SandboxClosed",
    "SandboxDenied",
    "SandboxError",
    "TransportError",
    "UnpickleRefused",
    "WorkerCrashed",
    "WorkerError",
    "WorkerStartError",
]


#: The name this project is installed under (the import name stays `agent_sandbox`). The
#: index's `agent-sandbox` is an unrelated project that also ships an `agent_sandbox` module.
DIST_NAME = "agent-sandbox-kit"


def install_hint(extra: str) -> str:
    """The pip command that installs one of our extras, for error messages."""
    return f"pip install '{DIST_NAME}[{extra}]'"


class SandboxError(Exception):
    """Base class of every agent_sandbox error, so callers can catch ours and only ours."""


class PolicyError(SandboxError, ValueError):
    """A policy could not be built; the message names the file, the key and what was expected.

    It is a ValueError because a bad policy is bad input, and code that validates
    configuration generally catches ValueError.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        key: str | None = None,
        line: int | None = None,
        expected: str | None = None,
    ) -> None:
        self.reason = message
        self.source = source
        self.key = key
        self.line = line
        self.expected = expected
        where = source or "<policy>"
        if line is not None:
            where = f"{where}:{line}"
        parts = [f"{where}: {message}"]
        if key:
            parts[0] = f"{where}: [{key}] {message}"
        if expected:
            parts.append(f"expected {expected}")
        super().__init__("; ".join(parts))


class PolicyNotFound(PolicyError, FileNotFoundError):
    """The policy file or the named preset does not exist."""


class ProviderUnavailable(SandboxError):
    """The provider named in the policy cannot run here; it is never replaced silently.

    The message names the provider and what is missing, so the user can install it or
    name another provider explicitly.
    """

    def __init__(self, provider: str, reason: str) -> None:
        self.provider = provider
        self.reason = reason
        if provider == "auto":
            fix = (
                "Install what is missing (bubblewrap, or a kernel with Landlock or user "
                "namespaces); `agent-sandbox doctor` shows what each sandbox needs"
            )
        else:
            fix = (
                "Install what is missing, or name another provider in the policy "
                '(`provider = "auto"` picks the strongest one that works; '
                "`agent-sandbox doctor` lists them)"
            )
        super().__init__(
            f"provider {provider!r} is not available on this machine: {reason}. {fix}."
        )


class WorkerError(SandboxError):
    """The worker process failed in a way that is not a policy decision."""


class WorkerStartError(WorkerError):
    """The worker did not answer its start-up handshake in time, or answered wrongly."""

    def __init__(self, reason: str, *, log_tail: str = "") -> None:
        self.reason = reason
        self.log_tail = log_tail
        msg = f"the sandbox worker failed to start: {reason}"
        if log_tail:
            msg += f"\n--- worker log (last lines) ---\n{log_tail}"
        super().__init__(msg)


class WorkerCrashed(WorkerError):
    """The worker died while a call was running (signal, os._exit, out of memory)."""

    def __init__(self, returncode: int | None, *, log_tail: str = "") -> None:
        self.returncode = returncode
        self.log_tail = log_tail
        super().__init__(f"the sandbox worker crashed ({describe_exit(returncode)})")


class TransportError(SandboxError):
    """The channel between parent and worker broke or carried a malformed message."""


class MessageTooLarge(TransportError):
    """One event or the result exceeded its size cap; the cap is a refusal, not a truncation."""

    def __init__(self, what: str, size: int, cap: int, setting: str) -> None:
        self.what = what
        self.size = size
        self.cap = cap
        self.setting = setting
        super().__init__(
            f"{what} of {size} bytes exceeds the cap of {cap} bytes; "
            f"raise `{setting}` in the policy to allow it"
        )


class UnpickleRefused(TransportError):
    """A pickle from the worker was refused before it was built
    (`agent_sandbox._host.intake.unpickle`).

    It names the opcode, the global or the budget at fault, and for a global outside the
    allowlist the policy line that would admit it. A TransportError because the bytes on the
    channel, not the user's code, are what failed; nothing from the stream ran in the host.
    """

    def __init__(
        self, reason: str, *, target: str = "", budget: str | None = None, hint: str = ""
    ) -> None:
        self.reason = reason
        self.target = target
        self.budget = budget
        self.hint = hint
        text = f"the host refused a pickled value from the worker: {reason}"
        if hint:
            text += f"; to allow it, add to the policy: {hint}"
        super().__init__(text)


class ChildException(SandboxError):
    """Stand-in for an exception raised in the worker whose class the host does not have (or
    may not rebuild, such as SystemExit); the class is never imported to find it.

    `.child_type` is the dotted class path in the worker, `.child_message` its message and
    `.denials` the policy refusals it carried. Subclasses made for one class path are named
    `ChildException[<module:Class>]` and also derive from the nearest builtin exception the worker
    reported (so `except KeyError` still catches a stand-in for a KeyError subclass).
    """

    def __init__(self, message: str = "", *, child_type: str = "", denials: Any = ()) -> None:
        self.child_type = child_type
        self.child_message = message
        self.denials = tuple(denials)
        super().__init__(f"{child_type}: {message}" if child_type else message)


class SandboxClosed(SandboxError):
    """The sandbox or the session was closed; open a new one."""


class CapacityError(SandboxError):
    """Every one of a sandbox's `max_sessions` slots stayed in a call for the whole wait."""

    def __init__(self, max_sessions: int, busy: int, waited: float) -> None:
        self.max_sessions = max_sessions
        self.busy = busy
        self.waited = waited
        super().__init__(
            f"no session slot came free within {waited:g} s: max_sessions = {max_sessions}, "
            f"and {busy} sessions are in a call; raise max_sessions or session_wait, or "
            "close sessions that are done"
        )


class LearningError(SandboxError):
    """Learning mode could not propose, write or apply a policy; names the path and the reason.

    It is not a PolicyError: the policy itself may be fine, what failed is the step around it
    (an unwritable directory, a target that is a symlink, a policy edited during the run).
    """

    def __init__(self, reason: str, *, path: str | None = None) -> None:
        self.reason = reason
        self.path = path
        super().__init__(f"{path}: {reason}" if path else reason)


class SandboxDenied(SandboxError):
    """A policy refused an operation; `.denial` holds the structured record.

    Inside the worker the guard records the denial before raising, so user code that
    swallows the exception still leaves the denial in the result.
    """

    #: The errno an OSError subclass carries, so code that checks `exc.errno` (as
    #: `pathlib.Path.exists` does for ENOENT) sees the error the OS would have given.
    os_errno: int | None = None

    def __init__(self, denial: Denial, *args: Any) -> None:
        self.denial = denial
        super().__init__(denial.message(), *args)
        if self.os_errno is not None and isinstance(self, OSError):
            as_os_error: OSError = self  # type: ignore[assignment]
            as_os_error.errno = self.os_errno
            as_os_error.strerror = denial.message()
            as_os_error.filename = denial.target

    def __str__(self) -> str:
        return self.denial.message()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.denial,))


class FileAccessDenied(SandboxDenied, PermissionError):
    """A file operation outside the policy; a PermissionError so ordinary code handles it."""

    os_errno = _errno.EACCES


class FileTransferRefused(SandboxDenied, PermissionError):
    """A session files API operation (put, get, list, remove) the policy or the name refused;
    `.denial.rule` is `files.transfer`, `files.hidden`, `limits.transfer` or `limits.scratch`."""

    os_errno = _errno.EACCES


class HiddenPathDenied(SandboxDenied, FileNotFoundError):
    """A path that must look absent, so code that probes for it moves on: a hidden name
    (`.env`, `*.pem`, ...), or a stat-only probe (`exists`, `isdir`) outside `files.read`."""

    os_errno = _errno.ENOENT


class NetworkDenied(SandboxDenied, ConnectionRefusedError):
    """A connect, bind or lookup outside the policy; a ConnectionRefusedError like a closed port."""

    os_errno = _errno.ECONNREFUSED


class ImportDenied(SandboxDenied, ModuleNotFoundError):
    """An import the policy does not allow; a ModuleNotFoundError so `try: import x` falls back."""

    def __init__(self, denial: Denial, *args: Any) -> None:
        super().__init__(denial, *args)
        self.name = denial.target


class EnvDenied(SandboxDenied, KeyError):
    """A host variable the policy does not pass; a KeyError, distinguishable from "not set"."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.denial.message()


class CallDenied(SandboxDenied, PermissionError):
    """A sensitive call (process, native code, dynamic code, ...) the policy does not grant."""

    os_errno = _errno.EPERM


class CodeRejected(SandboxDenied, SyntaxError):
    """The code uses syntax, names or attributes outside the policy's sub-language.

    Raised before the code runs; `.violations` lists every place at once (each with line,
    column, text and the policy line that would allow it), so a model fixes them in one round.
    """

    def __init__(self, denial: Denial, *args: Any, violations: Sequence[Any] = ()) -> None:
        super().__init__(denial, *args)
        self.msg = denial.message()
        self.violations = tuple(violations)


class AttributeDenied(SandboxDenied, AttributeError):
    """An attribute name computed at run time (getattr, format fields, attrgetter) that the
    policy's sub-language refuses; an AttributeError so `getattr(x, name, default)` and
    `hasattr` treat it like a missing attribute (the denial is still recorded)."""


class LimitExceeded(SandboxDenied):
    """A budget or resource limit was reached (time, memory, output, loop iterations, ...).

    It does not subclass a builtin error on purpose: ordinary `except Exception` handlers in
    user code must not be able to retry past a limit, and the worker re-raises it at the end.
    """


def describe_exit(returncode: int | None) -> str:
    """A human phrase for a process exit status (negative means killed by a signal)."""
    import signal

    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"
