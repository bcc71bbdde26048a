"""`sandboxed()`: plain functions (also from `__main__`) and LangChain tools under a policy."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from agent_sandbox import LimitExceeded, Policy
from agent_sandbox._errors import ChildException
from agent_sandbox.adapters import sandboxed
from agent_sandbox.providers import get_provider

BASE = 7


def policy(**limits: Any) -> Policy:
    return Policy(
        name="fn-test",
        imports={"allow": ["math", "json", "time"]},
        limits={"wall_seconds": 5, "output_bytes": 2048, **limits},
    )


def add_base(x: int) -> int:
    return x + BASE


def divide(a: float, b: float) -> float:
    return a / b


def custom_failure() -> None:
    class Oops(Exception):
        pass

    raise Oops("custom")


def spin() -> None:
    import time

    time.sleep(5)


def chatty(n: int) -> int:
    for i in range(n):
        print("line", i)
    return n


def where() -> str:
    import os

    return os.getcwd()


@pytest.fixture
def wrap():
    made: list[Any] = []

    def make(func: Any, **kw: Any) -> Any:
        w = sandboxed(func, policy=kw.pop("policy", policy()), **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def test_module_constants_and_return_values_cross(wrap):
    f = wrap(add_base)
    assert f(5) == 12
    assert f.__name__ == "add_base" and "BASE = 7" in f.program


def test_builtin_exceptions_come_back_as_their_type(wrap):
    f = wrap(divide)
    with pytest.raises(ZeroDivisionError) as info:
        f(1, 0)
    assert "division by zero" in str(info.value)
    assert f.last_result.error.type == "ZeroDivisionError"
    assert "return a / b" in f.last_result.error.traceback


def test_other_exceptions_come_back_as_a_stand_in(wrap):
    with pytest.raises(ChildException) as info:
        wrap(custom_failure)()
    assert info.value.child_type.endswith("Oops") and info.value.child_message == "custom"
    assert info.value.result.error.kind == "exception"


def test_limits_raise_limit_exceeded_with_the_denial(wrap):
    """It denies running past the wall-time limit (the function's process is killed)."""
    with pytest.raises(LimitExceeded) as info:
        wrap(spin, policy=policy(wall_seconds=1))()
    assert info.value.denial.rule == "limits.timeout"
    assert info.value.result.error.kind == "limit"
    with pytest.raises(LimitExceeded) as info2:
        wrap(chatty)(10_000)
    assert info2.value.denial.rule == "limits.output"


def test_runs_in_the_worker_not_the_host(wrap):
    import os

    assert wrap(where, policy=Policy(name="fn-os", imports={"allow": ["os"]}))() != os.getcwd()


def test_arguments_must_be_data(wrap):
    f = wrap(add_base)
    with pytest.raises(TypeError, match="JSON"):
        f(object())


def test_closures_and_lambdas_are_refused():
    y = 3

    def inner() -> int:
        return y

    with pytest.raises(TypeError, match="closure"):
        sandboxed(inner)
    with pytest.raises(TypeError):
        sandboxed(lambda: 1)


def test_function_defined_in_main_works(tmp_path):
    """A function defined in a script (`__main__`) runs: its source ships, not its module name."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        import math
        from agent_sandbox import Policy
        from agent_sandbox.adapters import sandboxed

        FACTOR = 2

        def register(f):
            return f

        @register
        def area(r):
            return round(math.pi * r * r * FACTOR, 3)

        with sandboxed(area, policy=Policy(name="s", imports={"allow": ["math"]})) as f:
            print(f(1))
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "6.283"


def test_sandboxed_langchain_tools():
    pytest.importorskip("langchain_core")
    from langchain_core.tools import BaseTool, tool

    @tool
    def hypot(a: float, b: float) -> float:
        """Length of the hypotenuse."""
        import math

        return math.hypot(a, b)

    class Chatty(BaseTool):
        name: str = "chatty"
        description: str = "print n lines"
        prefix: str = "line"

        def _run(self, n: int) -> int:
            for i in range(n):
                print(self.prefix, i)
            return n

    safe = sandboxed(hypot, policy=policy())
    loud = sandboxed(Chatty(), policy=policy())
    try:
        assert safe.invoke({"a": 3, "b": 4}) == 5.0
        assert loud.invoke({"n": 2}) == 2
        msg = loud.invoke(
            {"type": "tool_call", "id": "c1", "name": "chatty", "args": {"n": 10_000}}
        )
        assert msg.status == "error" and "[limits.output]" in msg.content
        assert safe.metadata["sandbox.policy"] == "fn-test"
    finally:
        safe.func.sandbox.close()
        loud.func.sandbox.close()


def make_set(n: int) -> set[int]:
    return set(range(n))


def test_objects_result_mode_returns_rich_values(wrap):
    """With `result_mode = "objects"` the value comes back as the object, not as data."""
    rich = wrap(make_set, policy=Policy(name="fn-objects", result_mode="objects"))
    assert rich(3) == {0, 1, 2}
    plain = wrap(make_set)
    with pytest.raises(TypeError, match="returned a set"):  # data-only: never a stand-in value
        plain(3)
    assert plain.run(3).value["__type__"] == "set"  # the whole result still describes it


def fetch_hello(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/hello", timeout=5) as reply:
        return str(reply.read().decode())


def test_fetch_tool_allowed_one_port_and_nothing_else(wrap):
    """It denies a sandboxed function fetching anywhere but the one allowed port (the host's
    egress proxy of a namespace provider judges it; Landlock alone refuses such a rule)."""
    import http.server
    import threading

    if not any(get_provider(n).probe().available for n in ("bwrap", "unshare")):
        pytest.skip("no namespace provider is available here")
    served: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args: Any) -> None:
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    allowed, other = (srv.server_address[1] for srv in servers)
    fetch = wrap(
        fetch_hello,
        policy=Policy(
            name="fetch-one-port",
            imports={"allow": ["urllib"]},
            net={"rules": [{"host": "127.0.0.1", "ports": allowed}]},
            limits={"wall_seconds": 10},
        ),
    )
    try:
        assert fetch(allowed) == "hello"
        refused = fetch.run(other)  # the proxy answers 403: urllib raises HTTPError
        assert refused.error is not None
        assert [(d.rule, d.target) for d in refused.denials if d.rule.startswith("net.")] == [
            ("net.connect", f"127.0.0.1:{other}")
        ]
        assert served == ["/hello"]
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
