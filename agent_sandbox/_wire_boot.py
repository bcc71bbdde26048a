"""The typed records the host sends a worker before it serves: `BootConfig` and `WorkerSetup`.

`BootConfig` is the boot configuration the host writes to the worker's boot pipe
(`_host/startup.py`); in it, `WorkerSetup` is what a provider's plan asks the worker to
apply to itself, whose nested fragments are records too (`LandlockRuleset`,
`SeccompProgram`, `ScratchTmpfs`, `GrantPins`, `EgressSetup`, `EgressRelay`,
`LimitReport`). `to_dict()` is exactly the JSON that crosses; `from_dict()` is the worker's
reading of it, refusing a key it does not know, one that is missing or a value of the wrong
type, naming it. Re-exported by `agent_sandbox._wire`.

Standard library only, no `typing` or `dataclasses` at run time (see `_wire_records`).
"""

from __future__ import annotations

from agent_sandbox._wire_records import BootError, _Fields, _read_fields, _Record

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "BootConfig",
    "EgressRelay",
    "EgressSetup",
    "GrantPins",
    "LandlockRuleset",
    "LimitReport",
    "ScratchTmpfs",
    "SeccompProgram",
    "WorkerSetup",
]


class _Fragment(_Fields):
    """A nested fragment of `WorkerSetup`: its fields by `_TYPES` (wire name -> type), those
    in `_REQUIRED` always set. Built from keywords or read from the wire; either way a key
    it does not know, a missing one or a value of the wrong type is a BootError naming it
    (a provider's plan that builds a wrong fragment fails where it is built)."""

    __slots__: tuple[str, ...] = ()
    _WHAT = "a worker_setup fragment"
    _TYPES: dict[str, Any] = {}
    _REQUIRED: tuple[str, ...] = ()

    def __init__(self, **fields: Any) -> None:
        _read_fields(self._WHAT, fields, self._TYPES, self._REQUIRED, BootError)
        for name in self.__slots__:
            object.__setattr__(self, name, fields.get(name))

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        return cls(**_read_fields(cls._WHAT, data, cls._TYPES, cls._REQUIRED, BootError))

    @classmethod
    def coerce(cls, value: Any) -> Any:
        """`value` as this record: a record of it kept, a dict read, None left None."""
        if value is None or isinstance(value, cls):
            return value
        return cls.from_dict(value)


class LandlockRuleset(_Fragment):
    """`landlock`: the ruleset the worker restricts itself with (`_landlock_sys.restrict_self`;
    built by `providers/_landlock.landlock_setup`): the lowest ABI it needs, `[path, access]`
    pairs, the TCP ports it may connect to and bind (None: not filtered), the scopes, notes
    on what it could not express, and the pins of its granted paths."""

    __slots__ = ("min_abi", "notes", "paths", "pins", "scope", "tcp_bind", "tcp_connect")
    _WHAT = "worker_setup's landlock"
    _TYPES = {
        "min_abi": int,
        "notes": list,
        "paths": list,
        "pins": dict,
        "scope": list,
        "tcp_bind": list,
        "tcp_connect": list,
    }
    _REQUIRED = ("min_abi", "paths")


class SeccompProgram(_Fragment):
    """`seccomp`, `seccomp_exec`: a BPF program, base64 (`providers/_seccomp.py`), with how
    many rules it holds and whether it refuses metadata changes (the guard then explains
    such a refusal as `files.metadata`)."""

    __slots__ = ("bpf", "metadata", "rules")
    _WHAT = "worker_setup's seccomp program"
    _TYPES = {"bpf": str, "metadata": bool, "rules": int}
    _REQUIRED = ("bpf",)


class ScratchTmpfs(_Fragment):
    """`scratch_tmpfs`: a private tmpfs of `bytes` over scratch at `path`, in a user
    namespace of the worker's own when `user_ns` (a non-root worker)."""

    __slots__ = ("bytes", "path", "user_ns")
    _WHAT = "worker_setup's scratch_tmpfs"
    _TYPES = {"bytes": int, "path": str, "user_ns": bool}
    _REQUIRED = ("bytes", "path")


class EgressSetup(_Fragment):
    """`egress`: the egress proxy's address inside the sandbox (`host`, `port`), the
    worker's end of the channel its listener goes to the host by (`fd`; -1 where the worker
    sends none: a VM, gVisor), the loopback services forwarded to the host
    (`[host, port]` pairs), and the route's refusal token (`token`: set by the host in the
    boot configuration only, never in a plan; `_denial.new_token`)."""

    __slots__ = ("fd", "forwards", "host", "port", "token")
    _WHAT = "worker_setup's egress"
    _TYPES = {"fd": int, "forwards": list, "host": str, "port": int, "token": str}
    _REQUIRED = ("fd", "host", "port")


class EgressRelay(_Fragment):
    """`egress_relay` (gVisor): the proxy address on the sandbox's loopback (`host`,
    `port`), the socket of the host's route it relays to, and the forwarded loopback
    services (`[host, port, socket]`)."""

    __slots__ = ("forwards", "host", "port", "socket")
    _WHAT = "worker_setup's egress_relay"
    _TYPES = {"forwards": list, "host": str, "port": int, "socket": str}
    _REQUIRED = ("forwards", "host", "port", "socket")


class LimitReport(_Fragment):
    """`limit_report` (gVisor): the file to report calls ended at `processes` in."""

    __slots__ = ("path", "processes")
    _WHAT = "worker_setup's limit_report"
    _TYPES = {"path": str, "processes": int}
    _REQUIRED = ("path", "processes")


class GrantPins(_Record):
    """`pins`: each granted path with the `[st_dev, st_ino]` the host saw when it walked it,
    or None where the path did not exist (`providers/_grants.py`); a read-only mapping of
    path -> pin, checked where it is built or read."""

    __slots__ = ("entries",)

    entries: dict[str, Any]

    def __init__(self, entries: Any) -> None:
        if not isinstance(entries, dict):
            raise BootError(f"worker_setup's pins must be a JSON object, not {type(entries)}")
        for path, pin in entries.items():
            ok = pin is None or (
                isinstance(pin, (list, tuple))
                and len(pin) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in pin)
            )
            if not isinstance(path, str) or not ok:
                raise BootError(
                    f"worker_setup's pins map a path to [st_dev, st_ino] or null, not "
                    f"{str(path)[:80]!r} -> {pin!r:.80}"
                )
        object.__setattr__(
            self, "entries", {p: None if v is None else list(v) for p, v in entries.items()}
        )

    @classmethod
    def coerce(cls, value: Any) -> Any:
        if value is None or isinstance(value, cls):
            return value
        return cls(value)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> Any:
        return self.entries[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.entries.get(key, default)

    def keys(self) -> list[str]:
        return list(self.entries)

    def items(self) -> list[tuple[str, Any]]:
        return list(self.entries.items())

    def __iter__(self) -> Any:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


#: The record of each nested fragment of `WorkerSetup`, by field.
_FRAGMENTS: dict[str, Any] = {
    "landlock": LandlockRuleset,
    "seccomp": SeccompProgram,
    "seccomp_exec": SeccompProgram,
    "scratch_tmpfs": ScratchTmpfs,
    "pins": GrantPins,
    "egress": EgressSetup,
    "egress_relay": EgressRelay,
    "limit_report": LimitReport,
}


class WorkerSetup(_Fields):
    """What a provider's launch plan asks the worker to apply to itself before it serves.

    Each field is None when the plan does not ask for it (the key is then absent from the
    wire, as it always was); the nested fragments are typed records (a provider may build
    one from a dict: it is read into its record, and refused with a BootError naming what
    is wrong):

    - `no_new_privs`, `drop_caps`: True to set `PR_SET_NO_NEW_PRIVS` / drop capabilities;
    - `landlock`: the Landlock ruleset (`LandlockRuleset`);
    - `seccomp`, `seccomp_exec`: BPF programs (`SeccompProgram`);
    - `scratch_tmpfs`: a private tmpfs over scratch (`ScratchTmpfs`);
    - `pins`: granted paths with the device and inode the host saw (`GrantPins`);
    - `egress`: the egress proxy's address and the worker's end of its channel
      (`EgressSetup`);
    - `egress_relay`: gVisor's relay from the sandbox's loopback to the host's route
      (`EgressRelay`);
    - `listen_path`: a socket path the worker binds itself (gVisor), instead of `listen_fd`;
    - `limit_report`: where and at which count to report calls ended at `limits.processes`
      (`LimitReport`).

    Read-only mapping access (`"egress" in setup`, `setup.get(...)`, `setup["landlock"]`,
    `dict(setup)`) sees the fields that are set, under their wire names; so do the
    fragments (`setup["seccomp"]["bpf"]`). `to_dict()` is the JSON that crosses.
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
    landlock: LandlockRuleset | None
    seccomp: SeccompProgram | None
    seccomp_exec: SeccompProgram | None
    scratch_tmpfs: ScratchTmpfs | None
    pins: GrantPins | None
    egress: EgressSetup | None
    egress_relay: EgressRelay | None
    listen_path: str | None
    limit_report: LimitReport | None

    def __init__(
        self,
        *,
        no_new_privs: bool | None = None,
        drop_caps: bool | None = None,
        landlock: LandlockRuleset | dict[str, Any] | None = None,
        seccomp: SeccompProgram | dict[str, Any] | None = None,
        seccomp_exec: SeccompProgram | dict[str, Any] | None = None,
        scratch_tmpfs: ScratchTmpfs | dict[str, Any] | None = None,
        pins: GrantPins | dict[str, Any] | None = None,
        egress: EgressSetup | dict[str, Any] | None = None,
        egress_relay: EgressRelay | dict[str, Any] | None = None,
        listen_path: str | None = None,
        limit_report: LimitReport | dict[str, Any] | None = None,
    ) -> None:
        values = locals()
        for name in ("no_new_privs", "drop_caps"):
            if values[name] is not None and not isinstance(values[name], bool):
                raise BootError(f"worker_setup's {name} must be true or false")
        if listen_path is not None and not isinstance(listen_path, str):
            raise BootError("worker_setup's listen_path must be a string")
        for name in self.__slots__:
            record = _FRAGMENTS.get(name)
            value = values[name] if record is None else record.coerce(values[name])
            object.__setattr__(self, name, value)

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
        """Read the wire form; an unknown or a missing key is an error naming it (each
        value is read by the worker step that uses it; `worker_setup` by its record)."""
        every = dict.fromkeys(cls.__slots__, object)
        fields = dict(_read_fields("the boot configuration", data, every, cls.__slots__, BootError))
        fields["worker_setup"] = WorkerSetup.from_dict(data["worker_setup"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (what `json.dumps` writes to the boot pipe)."""
        out = {n: getattr(self, n) for n in self.__slots__}
        out["worker_setup"] = self.worker_setup.to_dict()
        return out
