"""Regenerate docs/denials.md from agent_sandbox._denial.RULES (the one catalogue)."""

from pathlib import Path

from agent_sandbox import RULES

HEAD = """# Denials and their rule names

A denial is data before it is an exception: `Denial(rule, action, target, policy, hint,
detail, learned, internal)`; `learned` marks a would-be denial of learning mode, `internal` a
refusal a library raised and handled itself (kept for the operator, not a failure). `rule` is a stable dotted name; grep for it in a policy and here. The
exception raised inside user code subclasses both `SandboxDenied` and the builtin class
ordinary code expects (`PermissionError`, `FileNotFoundError`, `ModuleNotFoundError`,
`ConnectionRefusedError`, `KeyError`, `SyntaxError`). The worker records every denial before
raising, so `RunResult.denials` is complete even when the code swallows the exception.

The text a model reads names the rule, the target, the policy and the policy line that would
allow it:

```
[imports] import 'requests' refused by policy 'pure-computation'. To allow it, add to the
policy: [imports] allow = [..., "requests"]
```

Generated from `agent_sandbox/_denial.py` by `scripts/gen_denials_doc.py`.

| rule | meaning |
|---|---|
"""


TAIL = """
## How a call or a session ends, and what each side reads

| cause | the model reads (the tool's text) | the operator gets |
|---|---|---|
| wall-clock limit | `[limits.timeout] ...` with the setting that would allow it | `RunResult.error.rule == "limits.timeout"`, a denial; the worker is replaced |
| CPU time limit (every provider, behind a launcher too) | `[limits.cpu] ...` | `error.rule == "limits.cpu"`; the worker is replaced |
| the worker died (a signal, `os._exit`, a crash) | "the sandbox worker died during the call (exit status or signal)" | `error.type == "WorkerCrashed"`, `rule == "worker.crashed"`, the log tail |
| `session.interrupt()` during a call | the code's `KeyboardInterrupt` | `error.type == "KeyboardInterrupt"`; the session's variables stay |
| a cancelled `arun` (`asyncio.wait_for`, a cancelled task) | nothing (the call did not return) | `CancelledError` in the caller; the cell got `KeyboardInterrupt`; variables stay; the session is never left locked |
| Ctrl-C in the caller during `run` | nothing | `KeyboardInterrupt` in the caller; the cell got one too; variables stay |
| an interrupted cell that does not stop within the grace (2 s) | "the call was interrupted and did not stop within N s, so its worker was replaced" | `error.type == "Interrupted"`, `rule == "worker.crashed"`; the next call has `state_lost` |
| the session was evicted for `max_sessions` while idle | a notice naming `max_sessions` and the lost variables, on its next call | `RunResult.notices`, `state_lost == True` (never `SandboxClosed`) |
| the session was idle longer than `session_ttl` | a notice naming `session_ttl`, on its next call | `notices`, `state_lost == True` |
| every session slot stayed in a call for `session_wait` seconds | nothing (no call ran) | `CapacityError` with `max_sessions`, `busy` and `waited` |
| the sandbox or session was closed | "the sandbox was closed while the call was running" for a call cut short | `error.type == "SandboxClosed"`; a new call (`run` or `arun`) raises `SandboxClosed`, and so does a call waiting for the session |
| the agent's process ended (any way, SIGKILL included) | nothing | no process, cgroup or control directory of it remains (`_guardian.py`) |
"""


def main() -> None:
    rows = "".join(f"| `{rule}` | {text} |\n" for rule, text in sorted(RULES.items()))
    path = Path(__file__).resolve().parents[1] / "docs" / "denials.md"
    path.write_text(HEAD + rows + TAIL)


if __name__ == "__main__":
    main()
