"""The typed records that cross the boundary before a worker serves: their base and the
worker's answer.

Every record is immutable over `__slots__` (`_Record`), reads its wire form with one reader
(`_read_fields`: an unknown or a missing key, or a value of the wrong type, is an error
naming it) and writes it with `to_dict()`. Worker to host, here: `Hello`, its answer to the
handshake, and in it `SetupChecks`, what its set-up read back. Host to worker:
`agent_sandbox._wire_boot` (`BootConfig`, `WorkerSetup` and its fragments). Both are
re-exported by `agent_sandbox._wire`, the wire module both sides import.

Standard library only, and no `typing` or `dataclasses` at run time: the worker imports it
before arming, and its start imports neither.
"""

from __future__ import annotations

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["HELLO_BYTES", "BootError", "Hello", "HelloError", "SetupChecks"]


# -- The base of every record -----------------------------------------------------------------
#
# Immutable, written over `__slots__` (the worker's start imports neither `dataclasses` nor
# `typing`). `to_dict()` is exactly the JSON that crosses; `from_dict()` is the receiving
# side's reading of it, refusing a key it does not know, one that is missing, or a value of
# the wrong type (`_read_fields`).


class BootError(ValueError):
    """A boot configuration (or its `worker_setup`) the worker cannot read: names what."""


class _Record:
    """A frozen record over `__slots__`: equality by value, no attribute set after init."""

    __slots__: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable (use .replace(...))")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._values() == other._values()  # type: ignore[attr-defined]
        if isinstance(other, dict) and hasattr(self, "to_dict"):
            # A record reads as a mapping: equal to the JSON object of its wire form.
            return bool(self.to_dict() == other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (values hold dicts)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({fields})"


class _Fields(_Record):
    """Read-only mapping access over the fields that are set (not None), by wire name:
    `"egress" in setup`, `setup.get(...)`, `setup["landlock"]`, `dict(setup)`, `{**hello}`."""

    __slots__: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The wire form: the fields that are set, by name."""
        return {n: _wire_value(v) for n in self.__slots__ if (v := getattr(self, n)) is not None}

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.__slots__ and getattr(self, key) is not None

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self else default

    def keys(self) -> list[str]:
        return [n for n in self.__slots__ if getattr(self, n) is not None]

    def items(self) -> list[tuple[str, Any]]:
        return [(n, getattr(self, n)) for n in self.keys()]

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __bool__(self) -> bool:
        return bool(self.keys())


def _wire_value(value: Any) -> Any:
    """A field's JSON form (a nested record's `to_dict()`, a tuple as a list)."""
    if isinstance(value, _Record):
        return value.to_dict()  # type: ignore[attr-defined]
    if isinstance(value, tuple):
        return list(value)
    return value


def _type_name(want: Any) -> str:
    names = {bool: "true or false", int: "an integer", str: "a string", dict: "a JSON object"}
    names.update({list: "a JSON array"})
    return names.get(want, getattr(want, "__name__", str(want)))


def _read_fields(
    what: str,
    data: Any,
    types: dict[str, Any],
    required: tuple[str, ...],
    error: type[ValueError],
) -> dict[str, Any]:
    """`data` checked against `types` (field -> type): a JSON object, with no key outside
    `types`, every `required` one present, and each value of its type (an integer is never
    a bool; an optional field may be null). Raises `error` naming what to fix."""
    if not isinstance(data, dict):
        raise error(f"{what} must be a JSON object, not {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in types)
    missing = [n for n in required if n not in data]
    if unknown or missing:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {', '.join(k[:64] for k in unknown[:8])}")
        raise error(
            f"{what} has {'; '.join(parts)} (the host and the worker come from different "
            "versions of agent_sandbox?)"
        )
    for name, value in data.items():
        want = types[name]
        if value is None and name not in required:
            continue
        wrong = not isinstance(value, want) or (want is int and isinstance(value, bool))
        if wrong:
            raise error(f"{what}'s {name} must be {_type_name(want)}, not {type(value).__name__}")
    return data


# -- What a worker answers to the host's handshake -------------------------------------------
#
# `GET /hello` (`_worker/server.py`): the worker's interpreter, its pid and what its kernel
# steps read back (`SetupChecks`). The host reads it in one place,
# `agent_sandbox._host.intake.transport.WorkerClient.hello`, which bounds its size
# (`HELLO_BYTES`) and refuses any handshake `Hello.from_dict` cannot read.

#: The most of a handshake the host reads (a real one is under 2 KiB).
HELLO_BYTES = 64 * 1024


class HelloError(ValueError):
    """A worker's handshake the host refuses: names what is wrong with it."""


class SetupChecks(_Fields):
    """What a worker read back from the kernel after applying its `WorkerSetup`, and what
    its guards installed (`_worker/setup.prepare`, `_worker/_inworker.apply_worker_setup`).

    Each field is None when the worker did not report it (the key is then absent):

    - `rlimits`: the rlimits it lowered, by name (`{"cpu": n, ...}`);
    - `egress`: the port of the egress proxy's address it listens on (or relays);
    - `pins`: how many granted paths it checked against the host's pins;
    - `threads`: its thread count when it restricted itself (1);
    - `scratch_tmpfs`: the size of the tmpfs it mounted over scratch, in bytes;
    - `caps_dropped`: how many capabilities it dropped from its bounding set;
    - `landlock`: what `restrict_self` reported (`{"abi": n, "enforced": true, ...}`);
    - `exec_denied`: True once the exec filter is loaded;
    - `no_new_privs`, `cap_eff`, `seccomp`: NO_NEW_PRIVS, CapEff (16 hex digits) and the
      seccomp mode, as the kernel reports them;
    - `guards`: what the guards installed, with where their arming block is (`summary()`).
    """

    __slots__ = (
        "cap_eff",
        "caps_dropped",
        "egress",
        "exec_denied",
        "guards",
        "landlock",
        "no_new_privs",
        "pins",
        "rlimits",
        "scratch_tmpfs",
        "seccomp",
        "threads",
    )
    _TYPES = {
        "cap_eff": str,
        "caps_dropped": int,
        "egress": int,
        "exec_denied": bool,
        "guards": dict,
        "landlock": dict,
        "no_new_privs": int,
        "pins": int,
        "rlimits": dict,
        "scratch_tmpfs": int,
        "seccomp": int,
        "threads": int,
    }

    cap_eff: str | None
    caps_dropped: int | None
    egress: int | None
    exec_denied: bool | None
    guards: dict[str, Any] | None
    landlock: dict[str, Any] | None
    no_new_privs: int | None
    pins: int | None
    rlimits: dict[str, Any] | None
    scratch_tmpfs: int | None
    seccomp: int | None
    threads: int | None

    def __init__(self, **fields: Any) -> None:
        unknown = sorted(set(fields) - set(self.__slots__))
        if unknown:
            raise TypeError(f"SetupChecks has no field {', '.join(unknown)}")
        for name in self.__slots__:
            object.__setattr__(self, name, fields.get(name))

    @classmethod
    def from_dict(cls, data: Any) -> SetupChecks:
        """Read the wire form; an unknown key or a value of the wrong type is a HelloError."""
        fields = _read_fields("the handshake's checks", data, cls._TYPES, (), HelloError)
        return cls(**fields)


class Hello(_Fields):
    """What a worker answers to the host's handshake (`GET /hello`).

    `pid` is the worker's pid in its own pid namespace; `version` its interpreter's
    (major, minor, micro); `prefix`, `base_prefix` and `executable` its `sys` values (the
    host compares the base prefix with its own); `worker_id` the id the host gave it in its
    `BootConfig`; `checks` what its set-up read back (`SetupChecks`).
    """

    __slots__ = ("base_prefix", "checks", "executable", "pid", "prefix", "version", "worker_id")
    _TYPES = {
        "base_prefix": str,
        "checks": dict,
        "executable": str,
        "pid": int,
        "prefix": str,
        "version": list,
        "worker_id": str,
    }

    pid: int
    version: tuple[int, int, int]
    prefix: str
    base_prefix: str
    executable: str
    worker_id: str
    checks: SetupChecks

    def __init__(
        self,
        *,
        pid: int,
        version: tuple[int, int, int],
        prefix: str,
        base_prefix: str,
        executable: str,
        worker_id: str,
        checks: SetupChecks,
    ) -> None:
        values = locals()
        for name in self.__slots__:
            object.__setattr__(self, name, values[name])

    @classmethod
    def from_dict(cls, data: Any) -> Hello:
        """Read the wire form; an unknown or a missing key, or a value of the wrong type,
        is a HelloError naming it."""
        fields = dict(_read_fields("the handshake", data, cls._TYPES, cls.__slots__, HelloError))
        version = fields["version"]
        if len(version) != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in version
        ):
            raise HelloError(
                f"the handshake's version must be [major, minor, micro], not {version!r:.80}"
            )
        if fields["pid"] <= 0:
            raise HelloError(f"the handshake's pid must be positive, not {fields['pid']}")
        fields["version"] = tuple(version)
        fields["checks"] = SetupChecks.from_dict(fields["checks"])
        return cls(**fields)
