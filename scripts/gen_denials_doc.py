"""Regenerate docs/denials.md from agent_sandbox._denial.RULES (the one catalogue)."""

from pathlib import Path

from agent_sandbox import RULES

HEAD = """# Denials: whose refusal it was, what the model reads, what the trace keeps

A denial is data before it is an exception: `Denial(rule, action, target, policy, hint,
detail, learned, internal, count, origin, last)`. `rule` is a stable dotted name; grep for it
in a policy and in the table below. The exception raised inside user code subclasses both
`SandboxDenied` and the builtin class ordinary code expects (`PermissionError`,
`FileNotFoundError`, `ModuleNotFoundError`, `ConnectionRefusedError`, `KeyError`,
`SyntaxError`). The worker records every refusal before raising it, so `RunResult.denials`
is complete even when the code swallows the exception.

## Whose refusal is it?

One classification decides everything that follows: the model's text, `RunResult.ok`,
`RunResult.rules()`, the CLI's exit status, the LangSmith tags and metadata, the
`sandbox_refusal` custom event and CrewAI's tool failures.

- A refusal is **the user's** when it changed what the user's code got: its exception reached
  a frame of the user's code, or a library turned it into an error that reached the user's
  code. `requests.get("https://example.com")` under a policy with no net rule is refused at
  the name lookup; urllib3 and requests wrap that refusal into `ConnectionError`, which
  reaches the cell: the call is a refusal (`RunError.kind == "denied"`, rule
  `net.resolve`), not a traceback reported as a success. The same holds when the code
  catches the `ConnectionError` and goes on (`except ConnectionError: use_cache()`): the
  call completes, but the refusal is the user's (`ok` is false, CrewAI gets a failure, the
  model reads it under "Refused during this call").
- A refusal is **internal** only when a library raised it, handled it, and the user's code
  went on as if nothing had happened: matplotlib probing font folders outside
  `files.read`, requests looking for `~/.netrc` (a hidden name), urllib3 probing IPv6
  support at import. A successful plot has zero refusals of the user's; its probes stay in
  the trace (`RunResult.internal_denials()`, `denial_counts()`), never in the model's text.

How the worker decides (`agent_sandbox/_worker/audit.py`): when a refusal is raised, the innermost
frame of user code on the stack is watched until the library call it made ends. If an
exception reaches that frame, the refusals whose exception is in its chain (`__cause__`,
`__context__`, exception groups) are the user's, the others were handled inside the library;
if the call returns normally, they were all internal. A refusal raised straight into user
code, raised with no user frame on its stack (a library's own thread), or still undecided
when the call ends, is the user's: in doubt, the user's.

### What the host checks

The worker runs the code; it may be compromised. The host (`agent_sandbox/_host/intake/builder.py`)
therefore treats "internal" as a presentation downgrade only:

- a call whose code raised is never `ok`, whatever its refusals are said to be;
- a refusal that the call's error carries (named in the error's chain, or its rule and
  quoted target in the error's text) is the user's, and an error of kind `exception` that
  carries one becomes a refusal (`denied`);
- refusals of the code layer (`code.*`), limits, `guard.*`, `worker.*` and `result.*` are
  never internal;
- every refusal, internal ones included, stays in `RunResult.denials` with its count, and
  `denial_counts()` gives the raw totals by classification (in `to_dict()`, the LangSmith
  metadata `sandbox.denial_counts`, CrewAI's `details` and the operator's log).

What remains only as trustworthy as the worker: a compromised worker can still call a
refusal the code caught and swallowed "internal" (the model then does not read it; the trace
still lists it), or not report a refusal at all. Against such code, the kernel boundary is
what holds; the Python layer only explains.

## Counting, bounds and threads

Each distinct (rule, action, target, classification, origin) is kept once, with `count`,
its first occurrence in full and its last in `last`. Each classification keeps at most 200
distinct entries per call in the worker (256 in the host, whatever a worker sends); past
that, refusals are counted per rule in one `(other targets)` entry whose `last` is the
latest in full. A loop of a thousand harmless refusals cannot push a later one out of the
trace. Refusals a thread of the code meets between two calls are kept and reported with the
next call, with `origin == "between-calls"`.

## What the model reads

Every piece of data is quoted and escaped (no newline, control character, terminal escape
or bidirectional override survives; `agent_sandbox/_render.py`); the hint is a `[[grant]]`
fragment built by a serializer (`agent_sandbox/_hints.py`), which the host re-derives from
the rule and target instead of showing a worker's text:

```
REFUSED by the sandbox policy.
[net.resolve] resolve "example.com" refused by policy "analyst" (no [net] rule names this
host, so it is not resolved). To allow it, add to the policy file:
    [[grant]]
    net.rules = [{ host = "example.com", ports = "443" }]
Your code got requests.exceptions.ConnectionError: HTTPSConnectionPool(host='example.com', ...
Running the same code again will be refused again: ...
```

Pasted anywhere in a policy file, a `[[grant]]` element adds exactly that item to what the
policy and its `extends` chain allow (see `policies.md`, "Adding to what a policy
extends"). Where nothing added can allow it (a `deny` entry or a hidden name), the hint is
a sentence saying so. A timeout's hint names where the limit came from: the policy's
`limits.wall_seconds` (a grant raising it), or the tool's `timeout` option or the CLI's
`--timeout` (raise that; the policy did not stop it).

Tracebacks show the user's frames in full with their carets, library frames by their
import-relative path (`requests/api.py`) with long runs shortened, the sandbox's own frames
not at all, then one `Caused by:` line per chained exception. A file run from the CLI keeps
its name.

## The operator's log

`agent_sandbox.log_refusals(path_or_logger)` (or `AGENT_SANDBOX_REFUSAL_LOG=path`) writes
every refusal of every call as one JSON line: time, policy, fingerprint, session, tool,
worker, provider, rule, action, target, classification, origin, count, detail, hint and the
call's outcome. Off by default.

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
| the agent's process ended (any way, SIGKILL included) | nothing | no process, cgroup or control directory of it remains (`_host/guardian.py`) |
"""


def main() -> None:
    rows = "".join(f"| `{rule}` | {text} |\n" for rule, text in sorted(RULES.items()))
    path = Path(__file__).resolve().parents[1] / "docs" / "denials.md"
    path.write_text(HEAD + rows + TAIL)


if __name__ == "__main__":
    main()
