"""The providers' containment suite, run through `worker serve` on loopback.

The same hostile tests as `tests/providers/test_containment.py` (imported from it, so they
cannot drift apart), each call made as a remote one: claimed from a `LocalClaimBackend`
whose `worker serve` runs its worker under each local kernel provider in turn (what a pod
under runc does with `--provider landlock`), bound, called over mutual TLS. The verdicts
come from effects only, as there. What a remote worker adds to the target list: the pod's
own secrets, kept by `worker serve`, the worker's parent (`test_the_pods_secrets_...`).

The limits tests (fork bomb, memory, CPU, scratch) are not run here: in a pod those are the
template's resources, not the host's cgroups (docs/scale-out.md, "What only the pod holds").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox._host.remote.provider import LocalClaimBackend, RemoteProvider

from ..providers.conftest import (
    KERNEL_PROVIDERS,
    NATIVE,
    abstract_listener,
    arena,
    canary,
    environ_canary,
    hostile_policy,
    is_received,
    make_policy,
    skip_unless_available,
    tcp_listener,
)
from ..providers.test_containment import (
    test_allows_native_read_inside_the_policy,
    test_allows_writing_scratch_and_policy_write_paths,
    test_blocks_another_processes_abstract_unix_socket,
    test_blocks_connecting_to_a_host_pathname_unix_socket,
    test_blocks_ctypes_execve,
    test_blocks_ctypes_tcp_connect,
    test_blocks_native_read_of_a_tmp_canary_outside_scratch,
    test_blocks_posix_system,
    test_blocks_posixsubprocess_fork_exec,
    test_blocks_reading_a_host_processs_environ,
    test_blocks_reading_etc_shadow,
    test_blocks_writing_into_a_read_only_directory,
    test_blocks_writing_outside_the_policy,
    test_hides_the_existence_of_files_outside_the_policy,
)
from .conftest import BIND_SECRET, SESSION_KEY, Certs

__all__ = [  # the imported tests and fixtures are collected here, under this module's
    "abstract_listener",
    "arena",
    "canary",
    "environ_canary",
    "is_received",
    "make_policy",
    "tcp_listener",
    "test_allows_native_read_inside_the_policy",
    "test_allows_writing_scratch_and_policy_write_paths",
    "test_blocks_another_processes_abstract_unix_socket",
    "test_blocks_connecting_to_a_host_pathname_unix_socket",
    "test_blocks_ctypes_execve",
    "test_blocks_ctypes_tcp_connect",
    "test_blocks_native_read_of_a_tmp_canary_outside_scratch",
    "test_blocks_posix_system",
    "test_blocks_posixsubprocess_fork_exec",
    "test_blocks_reading_a_host_processs_environ",
    "test_blocks_reading_etc_shadow",
    "test_blocks_writing_into_a_read_only_directory",
    "test_blocks_writing_outside_the_policy",
    "test_hides_the_existence_of_files_outside_the_policy",
]


@pytest.fixture(scope="module")
def pods(certs: Certs) -> Iterator[dict[str, RemoteProvider]]:
    """One loopback 'pod pool' per kernel provider, started on first use, all ended after."""
    backends: list[LocalClaimBackend] = []
    providers: dict[str, RemoteProvider] = {}

    class Pools(dict[str, RemoteProvider]):
        """`pods["bwrap"]`: the bind secret in `worker serve`'s environment;
        `pods["bwrap:file"]`: in a file (a pod's secret volume); `pods["auto:file:kata"]`:
        `--provider auto` under a declared runtime (kata: not checkable here, unlike gVisor)."""

        def __missing__(self, key: str) -> RemoteProvider:
            name, *options = key.split(":")
            runtime = next((o for o in options if o != "file"), "")
            backend = LocalClaimBackend(
                certs.files(),
                bind_secret=BIND_SECRET,
                warm=1,
                max_workers=4,
                provider=name,
                runtime_boundary=runtime,
                bind_secret_file=_bind_secret_file(certs) if "file" in options else None,
            )
            backends.append(backend)
            self[key] = RemoteProvider(
                backend, session_key=SESSION_KEY, bind_secret=BIND_SECRET, tls=certs.tls()
            )
            return self[key]

    pools = Pools(providers)
    try:
        yield pools
    finally:
        for backend in backends:
            backend.close()


@pytest.fixture(params=KERNEL_PROVIDERS)
def kernel_provider(request: pytest.FixtureRequest) -> str:
    """Each local kernel provider inside `worker serve` (skipped where it cannot run)."""
    name = str(request.param)
    skip_unless_available(name)
    return name


@pytest.fixture
def hostile(pods: dict[str, RemoteProvider]) -> Any:
    """`hostile(provider, policy, code)` as in the providers' suite, through a remote worker
    whose in-pod provider is `provider`; the result must say so."""

    def run(provider: str, policy: Any, code: str) -> Any:
        with pods[provider].session(policy, thread="hostile-" + os.urandom(4).hex()) as session:
            result = session.run(NATIVE + code)
        assert result.provider == "remote" and provider in result.stack, result.stack
        return result

    return run


def _bind_secret_file(certs: Certs) -> str:
    """The bind secret as a pod holds it: a file `worker serve` reads at its start."""
    path = os.path.join(certs.dir, "bind-secret")
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(BIND_SECRET + "\n")
    return path


def _secrets_code(certs: Certs) -> str:
    return (
        f"print('key', repr(nread({certs.server!r}))[:80])\n"
        "print('environ', repr(nread(f'/proc/{os.getppid()}/environ')))\n"
        f"print('secret-file', repr(nread({_bind_secret_file(certs)!r})))\n"
    )


def test_the_pods_secrets_stay_out_of_the_workers_reach(
    kernel_provider: str, arena: dict[str, Path], hostile: Any, certs: Certs
) -> None:
    """Hostile native code reads neither the pod's TLS key nor the bind secret in the
    environment `worker serve` was started with (`/proc/<its parent>/environ`)."""
    result = hostile(kernel_provider, hostile_policy(arena), _secrets_code(certs))
    assert result.error is None, result.error
    assert "PRIVATE KEY" not in result.stdout, result.stdout
    assert BIND_SECRET not in result.stdout, result.stdout
    assert result.stdout.startswith("key ")  # the code ran


def test_the_pods_secret_files_stay_out_of_the_workers_reach(
    kernel_provider: str, arena: dict[str, Path], pods: dict[str, RemoteProvider], certs: Certs
) -> None:
    """The same with the bind secret in a file, as a pod holds it (its secret volume, read by
    `worker serve` at its start): neither the key nor that file is readable by the code."""
    policy = hostile_policy(arena)
    with pods[kernel_provider + ":file"].session(policy, thread="files") as session:
        result = session.run(NATIVE + _secrets_code(certs))
    assert result.error is None, result.error
    assert kernel_provider in result.stack, result.stack
    assert "secret-file " in result.stdout, result.stdout  # the code ran to the end
    assert "PRIVATE KEY" not in result.stdout, result.stdout
    assert BIND_SECRET not in result.stdout, result.stdout


def test_auto_under_a_declared_runtime_takes_a_kernel_provider_that_hides_the_secrets(
    arena: dict[str, Path], pods: dict[str, RemoteProvider], certs: Certs
) -> None:
    """`--provider auto --runtime-boundary R` (what the manifests give a gVisor or Kata pod)
    starts the worker under the strongest kernel provider that works here, not under
    `subprocess`: the result names the runtime and that provider, and the code reads neither
    secret. (Under gVisor itself this is on paper: its probe decides there.)"""
    from agent_sandbox.providers import AutoProvider

    probe = AutoProvider().probe()
    if not probe.available:
        pytest.skip(f"auto: {probe.reason}")
    policy = hostile_policy(arena, provider="auto")
    with pods["auto:file:kata"].session(policy, thread="auto") as session:
        result = session.run(NATIVE + _secrets_code(certs))
    assert result.error is None, result.error
    assert result.stack[0] == "kata" and result.stack[1] in KERNEL_PROVIDERS, result.stack
    assert result.boundary.startswith("kata+") and "subprocess" not in result.boundary
    assert "secret-file " in result.stdout, result.stdout
    assert "PRIVATE KEY" not in result.stdout, result.stdout
    assert BIND_SECRET not in result.stdout, result.stdout


def test_without_a_kernel_provider_the_pods_secrets_are_in_reach(
    arena: dict[str, Path], hostile: Any, pods: dict[str, RemoteProvider], certs: Certs
) -> None:
    """The control: the same code under `subprocess` in the pod (no kernel boundary, accepted
    in so many words) reads both, so the test above can fail; and it is why a pod under
    gVisor must keep its secrets out of the worker's view, or accept this
    (docs/scale-out.md, which layer holds in each runtime class)."""
    policy = hostile_policy(arena, no_kernel_boundary="accepted")
    result = hostile("subprocess", policy, _secrets_code(certs))
    assert "PRIVATE KEY" in result.stdout
    assert BIND_SECRET in result.stdout
    with pods["subprocess:file"].session(policy, thread="weak") as session:
        weak = session.run(NATIVE + _secrets_code(certs))
    assert "PRIVATE KEY" in weak.stdout and f"secret-file '{BIND_SECRET}" in weak.stdout
