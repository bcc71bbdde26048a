"""The typed records that cross the boundary before a worker serves, both ways.

Host to worker: `BootConfig`, the boot configuration written to the worker's boot pipe, and
in it `WorkerSetup`, what a provider's plan asks the worker to apply to itself. Worker to
host: `Hello`, its answer to the handshake, and in it `SetupChecks`, what its set-up read
back. Re-exported by `agent_sandbox._wire`, the wire module both sides import.

Standard library only, and no `typing` or `dataclasses` at run time: the worker imports it
before arming, and its start imports neither.
"""

from __future__ import annotations

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "HELLO_BYTES",
    "BootConfig",
    "BootError",
    "Hello",
    "HelloError",
    "SetupChecks",
    "WorkerSetup",
]


# -- What the host tells a worker before it serves -------------------------------------------
#
# Two records, immutable, written over `__slots__` (the worker's start imports neither
# `dataclasses` nor `typing`): `WorkerSetup`, the kernel steps and services a provider's plan
# asks the worker to apply to itself, and `BootConfig`, the whole boot configuration the host
# writes to the worker's boot pipe. `to_dict()` is exactly the JSON that crosses; `from_dict()`
# is the worker's reading of it, refusing a key it does not know or one that is missing.


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
    if isinstance(value, _Fields):
        return value.to_dict()
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


class WorkerSetup(_Fields):
    """What a provider's launch plan asks the worker to apply to itself before it serves.

    Each field is None when the plan does not ask for it (the key is then absent from the
    wire, as it always was); the values are JSON-safe fragments built by `providers/`:

    - `no_new_privs`, `drop_caps`: True to set `PR_SET_NO_NEW_PRIVS` / drop capabilities;
    - `landlock`: the Landlock ruleset (`providers/_landlock.landlock_setup`);
    - `seccomp`, `seccomp_exec`: BPF programs, base64 (`providers/_seccomp.py`);
    - `scratch_tmpfs`: a private tmpfs over scratch (`{"bytes": n, ...}`);
    - `pins`: granted paths with the device and inode the host saw (`providers/_grants.py`);
    - `egress`: the egress proxy's address and the worker's end of its channel;
    - `egress_relay`: gVisor's relay from the sandbox's loopback to the host's route;
    - `listen_path`: a socket path the worker binds itself (gVisor), instead of `listen_fd`;
    - `limit_report`: where and at which count to report calls ended at `limits.processes`.

    Read-only mapping access (`"egress" in setup`, `setup.get(...)`, `setup["landlock"]`,
    `dict(setup)`) sees the fields that are set, under their wire names.
    """

    __slots__ = (
        "drop_caps",
        "egress",
        "egress_relay",
        "landlock",
        "limit_report",
        "listen_path",
        "no_new_privs",
        "pins",
        "scratch_tmpfs",
        "seccomp",
        "seccomp_exec",
    )

    no_new_privs: bool | None
    drop_caps: bool | None
    landlock: dict[str, Any] | None
    seccomp: dict[str, Any] | None
    seccomp_exec: dict[str, Any] | None
    scratch_tmpfs: dict[str, Any] | None
    pins: dict[str, Any] | None
    egress: dict[str, Any] | None
    egress_relay: dict[str, Any] | None
    listen_path: str | None
    limit_report: dict[str, Any] | None

    def __init__(
        self,
        *,
        no_new_privs: bool | None = None,
        drop_caps: bool | None = None,
        landlock: dict[str, Any] | None = None,
        seccomp: dict[str, Any] | None = None,
        seccomp_exec: dict[str, Any] | None = None,
        scratch_tmpfs: dict[str, Any] | None = None,
        pins: dict[str, Any] | None = None,
        egress: dict[str, Any] | None = None,
        egress_relay: dict[str, Any] | None = None,
        listen_path: str | None = None,
        limit_report: dict[str, Any] | None = None,
    ) -> None:
        values = locals()
        for name in self.__slots__:
            object.__setattr__(self, name, values[name])

    @classmethod
    def from_dict(cls, data: Any) -> WorkerSetup:
        """Read the wire form; a key this side does not know is an error naming it."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise BootError(f"worker_setup must be a JSON object, not {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.__slots__))
        if unknown:
            raise BootError(
                f"worker_setup has keys this worker does not know: {', '.join(unknown)} "
                "(the host and the worker come from different versions of agent_sandbox?)"
            )
        return cls(**data)

    def replace(self, **changes: Any) -> WorkerSetup:
        """A copy with `changes` (None unsets a field)."""
        return type(self)(**{**{n: getattr(self, n) for n in self.__slots__}, **changes})


class BootConfig(_Record):
    """The boot configuration the host writes to a worker's boot pipe (`_host/startup.py`).

    `token` authenticates the host's requests; `worker_id` names the worker in its replies;
    `listen_fd` is the inherited listening socket (a template's or a VM's worker puts its
    own in its place); `policy` is the policy's wire form; `sys_path` and `package_dirs` are
    the import roots and package folders; `scratch` is the working directory as the worker
    sees it; `worker_setup` is the plan's `WorkerSetup`; `host_env_names` are the host's
    variable names (the environment guard's reference); `die_with_parent` asks the worker to
    end with the host's launch thread, `keeper` to run under a keeper (`_worker/boot.py`);
    `life_fd` is the worker's end of the agent's life line (`WorkerSpec.life_fd`), or None.
    """

    __slots__ = (
        "die_with_parent",
        "host_env_names",
        "keeper",
        "life_fd",
        "listen_fd",
        "package_dirs",
        "policy",
        "scratch",
        "sys_path",
        "token",
        "worker_id",
        "worker_setup",
    )

    token: str
    worker_id: str
    listen_fd: int
    policy: dict[str, Any]
    sys_path: list[str]
    package_dirs: dict[str, str]
    scratch: str
    worker_setup: WorkerSetup
    host_env_names: list[str]
    die_with_parent: bool
    keeper: bool
    life_fd: int | None

    def __init__(
        self,
        *,
        token: str,
        worker_id: str,
        listen_fd: int,
        policy: dict[str, Any],
        sys_path: list[str],
        package_dirs: dict[str, str],
        scratch: str,
        worker_setup: WorkerSetup,
        host_env_names: list[str],
        die_with_parent: bool,
        keeper: bool,
        life_fd: int | None = None,
    ) -> None:
        values = locals()
        for name in self.__slots__:
            object.__setattr__(self, name, values[name])

    @classmethod
    def from_dict(cls, data: Any) -> BootConfig:
        """Read the wire form; an unknown or a missing key is an error naming it."""
        if not isinstance(data, dict):
            raise BootError(f"the boot configuration must be a JSON object, not {type(data)}")
        unknown = sorted(set(data) - set(cls.__slots__))
        missing = [n for n in cls.__slots__ if n not in data]
        if unknown or missing:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(missing)}")
            if unknown:
                parts.append(f"unknown {', '.join(unknown)}")
            raise BootError(
                f"the boot configuration has {'; '.join(parts)} (the host and the worker "
                "come from different versions of agent_sandbox?)"
            )
        fields = dict(data)
        fields["worker_setup"] = WorkerSetup.from_dict(data["worker_setup"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (what `json.dumps` writes to the boot pipe)."""
        out = {n: getattr(self, n) for n in self.__slots__}
        out["worker_setup"] = self.worker_setup.to_dict()
        return out


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
