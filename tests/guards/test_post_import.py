"""Deferred patches: modules imported after arming are patched when they load."""

from __future__ import annotations

from pathlib import Path

from agent_sandbox import Policy, Sandbox

POLICY = Policy(
    name="post-import",
    imports={"allow": ["sys", "subprocess", "wrapt"]},
    code={"enabled": False},
    limits={"wall_seconds": 20},
)


def test_blocks_process_exec_after_meta_path_was_cleared(tmp_path: Path) -> None:
    """It denies subprocess.run imported after user code stripped sys.meta_path's finders."""
    marker = tmp_path / "marker"
    code = (
        "import sys\n"
        "assert 'subprocess' not in sys.modules\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if isinstance(f, type)]  # the stdlib's\n"
        "import subprocess\n"
        "try:\n"
        f"    subprocess.run(['touch', {str(marker)!r}])\n"
        "    outcome = 'ran'\n"
        "except PermissionError:\n"
        "    outcome = 'refused'\n"
        "outcome"
    )
    with Sandbox(POLICY, warm=0) as sb:
        result = sb.run(code)
    assert result.value == "refused", result.error
    assert not marker.exists()
    assert "api.process-exec" in result.rules()


def test_user_code_can_still_import_the_whole_wrapt_package() -> None:
    """It loads wrapt's C wrapper type without leaving a partial `wrapt` module behind."""
    with Sandbox(POLICY, warm=0) as sb:
        result = sb.run(
            "import sys\nbefore = 'wrapt' in sys.modules\nimport wrapt\n"
            "[before, hasattr(wrapt, 'ObjectProxy'), hasattr(wrapt, 'register_post_import_hook')]"
        )
    assert result.value == [False, True, True], result.error


def test_the_worker_does_not_import_the_wrapt_package_at_start_up() -> None:
    """It keeps wrapt's heavy package imports (asyncio, importlib.metadata) out of start-up."""
    with Sandbox(POLICY, warm=0) as sb:
        result = sb.run(
            "import sys\nsorted(m for m in ('wrapt', 'asyncio', 'importlib.metadata') "
            "if m in sys.modules)"
        )
    assert result.value == [], result.error
