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

from agent_sandbox.providers._remote import LocalClaimBackend, RemoteProvider

from ..providers.conftest import (
    KERNEL_PROVIDERS,
    NATIVE,
    abstract_listener,
    arena,
    canary,
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
    test_blocks_reading_etc_shadow,
    test_blocks_reading_the_parents_environ,
    test_blocks_writing_into_a_read_only_directory,
    test_blocks_writing_outside_the_policy,
    test_hides_the_existence_of_files_outside_the_policy,
)
from .conftest import BIND_SECRET, SESSION_KEY, Certs

__all__ = [  # the imported tests and fixtures are collected here, under this module's
    "abstract_listener",
    "arena",
    "canary",
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
    "test_blocks_reading_etc_shadow",
    "test_blocks_reading_the_parents_environ",
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
        def __missing__(self, name: str) -> RemoteProvider:
            backend = LocalClaimBackend(
                certs.files(), bind_secret=BIND_SECRET, warm=1, max_workers=4, provider=name
            )
            backends.append(backend)
            self[name] = RemoteProvider(
                backend, session_key=SESSION_KEY, bind_secret=BIND_SECRET, tls=certs.tls()
            )
            return self[name]

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


def _secrets_code(certs: Certs) -> str:
    return (
        f"print('key', repr(nread({certs.server!r}))[:80])\n"
        "print('environ', repr(nread(f'/proc/{os.getppid()}/environ')))\n"
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


def test_without_a_kernel_provider_the_pods_secrets_are_in_reach(
    arena: dict[str, Path], hostile: Any, certs: Certs
) -> None:
    """The control: the same code under `subprocess` in the pod (no kernel boundary, accepted
    in so many words) reads both, so the test above can fail; and it is why a pod under
    gVisor must keep its secrets out of the worker's view, or accept this
    (docs/scale-out.md, which layer holds in each runtime class)."""
    policy = hostile_policy(arena, no_kernel_boundary="accepted")
    result = hostile("subprocess", policy, _secrets_code(certs))
    assert "PRIVATE KEY" in result.stdout
    assert BIND_SECRET in result.stdout
