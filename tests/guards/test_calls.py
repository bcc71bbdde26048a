"""The sensitive-call registry: categories, function rules, precedence, C twins, effects."""

from __future__ import annotations

import pickle
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy
from agent_sandbox._errors import CallDenied, PolicyError
from agent_sandbox.guards._calls import REGISTRY
from agent_sandbox.policies._model import SENSITIVE_CATEGORIES

MODULES = ["os", "posix", "subprocess", "pickle", "_pickle", "marshal", "ctypes", "sys", "gc",
           "dataclasses", "collections", "logging", "io", "signal", "_posixsubprocess"]  # fmt: skip


def attempt(guard: Any, body: str) -> Any:
    guard.run(
        "import " + ", ".join(MODULES) + "\n"
        f"try:\n{textwrap.indent(body, '    ')}\n"
        "except Exception as exc:\n    result = type(exc).__name__\n"
    )
    return guard.namespace.get("result")


def make(armed: Callable[..., Any], **api: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return armed(name="calls-danger", imports={"allow": MODULES}, api=api)


@pytest.mark.parametrize(
    "body",
    [
        "result = subprocess.run(['touch', MARKER])",
        "result = subprocess.Popen(['touch', MARKER]).wait()",
        "result = subprocess.check_output('touch ' + MARKER, shell=True)",
        "result = os.system('touch ' + MARKER)",
        "result = os.popen('touch ' + MARKER).read()",
        "result = posix.system('touch ' + MARKER)",
        "result = os.posix_spawn('/usr/bin/touch', ['touch', MARKER], {})",
        "result = os.spawnv(os.P_WAIT, '/usr/bin/touch', ['touch', MARKER])",
    ],
)
def test_blocks_process_execution(armed: Callable[..., Any], tmp_path: Path, body: str) -> None:
    """It denies every process-execution route; the marker file is never created."""
    guard = make(armed)
    guard.namespace["MARKER"] = str(tmp_path / "marker")
    assert attempt(guard, body) == "CallDenied"
    assert not (tmp_path / "marker").exists()
    assert guard.denials()[-1].rule == "api.process-exec"


def test_blocks_fork_exec_c_twin(armed: Callable[..., Any], tmp_path: Path) -> None:
    """It denies `_posixsubprocess.fork_exec`, the C twin under subprocess."""
    guard = make(armed)
    assert attempt(guard, "result = _posixsubprocess.fork_exec()") == "CallDenied"


def test_blocks_process_control(armed: Callable[..., Any]) -> None:
    """It denies fork, kill and signal handlers set by user code."""
    guard = make(armed)
    assert attempt(guard, "result = os.kill(os.getpid(), 0)") == "CallDenied"
    assert attempt(guard, "result = signal.signal(signal.SIGUSR1, lambda *a: None)") == "CallDenied"
    assert attempt(guard, "result = os.fork()") == "CallDenied"


def test_a_function_rule_beats_its_category(armed: Callable[..., Any], tmp_path: Path) -> None:
    """It allows `subprocess.run` granted by name although `process-exec` is denied."""
    guard = make(armed, allow=["subprocess.run"], deny=["process-exec"])
    guard.namespace["MARKER"] = str(tmp_path / "marker")
    assert attempt(guard, "result = subprocess.run(['touch', MARKER]).returncode") == 0
    assert (tmp_path / "marker").exists()
    assert attempt(guard, "result = os.system('true')") == "CallDenied"


def test_deny_beats_allow(armed: Callable[..., Any], tmp_path: Path) -> None:
    """It lets a deny of `os.system` beat the `process-exec` grant."""
    guard = make(armed, allow=["process-exec"], deny=["os.system"])
    guard.namespace["MARKER"] = str(tmp_path / "marker")
    assert attempt(guard, "result = os.system('touch ' + MARKER)") == "CallDenied"
    assert not (tmp_path / "marker").exists()
    assert guard.denials()[-1].hint == "remove 'os.system' from [api] deny"
    assert attempt(guard, "result = subprocess.run(['true']).returncode") == 0


def test_blocks_pickle_loads_and_its_twin(armed: Callable[..., Any], tmp_path: Path) -> None:
    """It denies pickle.loads, pickle.load and `_pickle.loads`; the payload never runs."""
    guard = make(armed)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> Any:
            import os

            return (os.system, (f"touch {marker}",))

    guard.namespace["PAYLOAD"] = pickle.dumps(Payload())
    assert attempt(guard, "result = pickle.loads(PAYLOAD)") == "CallDenied"
    assert attempt(guard, "result = _pickle.loads(PAYLOAD)") == "CallDenied"
    assert attempt(guard, "result = pickle.load(io.BytesIO(PAYLOAD))") == "CallDenied"
    assert attempt(guard, "result = marshal.loads(marshal.dumps(1))") == "CallDenied"
    assert not marker.exists()


def test_a_granted_unpickle_cannot_run_another_category(
    armed: Callable[..., Any], tmp_path: Path
) -> None:
    """It still denies `os.system` reached from a stream unpickled under a grant."""
    guard = make(armed, allow=["deserialization"])
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> Any:
            import os

            return (os.system, (f"touch {marker}",))

    guard.namespace["PAYLOAD"] = pickle.dumps(Payload())
    assert attempt(guard, "result = pickle.loads(pickle.dumps([1, 2]))") == [1, 2]
    assert attempt(guard, "result = pickle.loads(PAYLOAD)") == "CallDenied"
    assert not marker.exists()


def test_blocks_eval_exec_compile_of_strings_from_user_code(armed: Callable[..., Any]) -> None:
    """It denies dynamic code from user code while the standard library keeps using it."""
    guard = make(armed)
    assert attempt(guard, "result = eval('1 + 1')") == "CallDenied"
    assert attempt(guard, "exec('result = 2')") == "CallDenied"
    assert attempt(guard, "result = compile('1', '<s>', 'eval')") == "CallDenied"
    body = (
        "@dataclasses.dataclass\nclass Point:\n    x: int\n"
        "P = collections.namedtuple('P', 'a b')\nresult = (Point(1).x, P(1, 2).b)"
    )
    assert attempt(guard, body) == (1, 2)


def test_granted_dynamic_code_runs(armed: Callable[..., Any]) -> None:
    """It allows eval when `dynamic-code` is granted (the code layer is off here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = armed(
            name="dyn-danger", imports={"allow": MODULES}, api={"allow": ["dynamic-code"]},
            code={"enabled": False},
        )  # fmt: skip
    assert attempt(guard, "result = eval('6 * 7')") == 42


def test_granted_dynamic_code_goes_through_the_code_layer(armed: Callable[..., Any]) -> None:
    """It checks a string given to eval against the code layer when that layer is enabled."""
    pytest.importorskip("agent_sandbox.guards._code_check")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = armed(
            name="dyn-danger", imports={"allow": MODULES}, api={"allow": ["dynamic-code"]}
        )
    assert attempt(guard, "result = eval('6 * 7')") == 42
    built = "'object.' + '_' * 2 + 'subclasses' + '_' * 2 + '()'"
    assert attempt(guard, f"result = eval({built})") == "CodeRejected"


def test_blocks_introspection_from_user_code(armed: Callable[..., Any]) -> None:
    """It denies frame and garbage-collector introspection; logging still works."""
    guard = make(armed)
    assert attempt(guard, "result = sys._getframe(0)") == "CallDenied"
    assert attempt(guard, "result = len(gc.get_objects())") == "CallDenied"
    assert attempt(guard, "result = gc.get_referrers(os)") == "CallDenied"
    body = "logging.getLogger('x').warning('hello')\nresult = 'logged'"
    assert attempt(guard, body) == "logged"


def test_blocks_loading_a_native_library(armed: Callable[..., Any], tmp_path: Path) -> None:
    """It denies ctypes.CDLL and cdll.LoadLibrary; libc's system never runs."""
    guard = make(armed)
    guard.namespace["MARKER"] = str(tmp_path / "marker")
    body = "result = ctypes.CDLL('libc.so.6').system(('touch ' + MARKER).encode())"
    assert attempt(guard, body) == "CallDenied"
    assert attempt(guard, "result = ctypes.cdll.LoadLibrary('libc.so.6')") == "CallDenied"
    assert attempt(guard, "result = getattr(ctypes.cdll, 'libc.so.6')") == "CallDenied"
    assert not (tmp_path / "marker").exists()


def test_learning_mode_records_and_runs_the_call(armed: Callable[..., Any], tmp_path: Path) -> None:
    """It lets the call happen in learning mode and records the denial as learned."""
    guard = armed(mode="learn", imports={"allow": MODULES})
    guard.namespace["MARKER"] = str(tmp_path / "marker")
    assert attempt(guard, "result = subprocess.run(['touch', MARKER]).returncode") == 0
    learned = [d for d in guard.denials() if d.rule == "api.process-exec"]
    assert learned and all(d.learned for d in learned)


def test_denial_is_a_permission_error_naming_the_line(armed: Callable[..., Any]) -> None:
    """It raises a PermissionError naming the rule, the function and the exact grant."""
    guard = make(armed)
    with pytest.raises(PermissionError) as info:
        guard.run("import os\nos.system('true')")
    assert isinstance(info.value, CallDenied)
    text = str(info.value)
    assert "[api.process-exec]" in text and '"os.system"' in text and '"calls-danger"' in text
    assert '[[grant]]\n    api.allow = ["os.system"]' in text


@pytest.mark.parametrize("category", ["deserialization", "dynamic-code"])
def test_granting_a_dangerous_category_warns_at_load(category: str) -> None:
    """It prints a warning when a policy grants deserialization or dynamic code."""
    with pytest.warns(UserWarning, match=category):
        Policy(name="w-danger", api={"allow": [category]})


def test_an_unknown_category_is_a_load_error() -> None:
    """It refuses a policy that grants an unknown category, naming it."""
    with pytest.raises(PolicyError, match="teleportation"):
        from agent_sandbox.policies import policy_from_dict

        policy_from_dict({"name": "x", "api": {"allow": ["teleportation"]}})


def test_every_registry_category_is_a_policy_category() -> None:
    """It keeps the registry and the policy's category list in step."""
    assert {entry.category for entry in REGISTRY} == set(SENSITIVE_CATEGORIES)


def test_wrapped_frame_readers_still_answer_for_their_caller(armed: Callable[..., Any]) -> None:
    """It keeps eval/exec/compile and the frame getters working as if unwrapped."""
    import collections
    import inspect
    import sys

    armed(imports={"allow": ["os"]})  # installed, not armed: what libraries see all the time

    def where() -> tuple[str, str, str, str]:
        return (
            sys._getframe(0).f_code.co_name,
            sys._getframe(1).f_code.co_name,
            inspect.currentframe().f_code.co_name,  # type: ignore[union-attr]
            inspect.stack()[0].function,
        )

    caller = "test_wrapped_frame_readers_still_answer_for_their_caller"
    assert where() == ("where", caller, "where", "where")
    assert collections.namedtuple("P", "a").__module__ == __name__
    local = 5
    assert eval("local + 1") == 6 and local == 5
    namespace: dict[str, Any] = {}
    exec(compile("def q(a: int): pass", "<s>", "exec"), namespace)
    assert namespace["q"].__annotations__ == {"a": "int"}  # this module's __future__ flag
