"""The `agent-sandbox` command line (also `python -m agent_sandbox`).

Commands:

* `run (-c CODE | FILE) [--policy P] [--provider X] [--json] [--timeout S] [--in FILE]...
  [--out DIR] [--force] [--no-out]`: run code in a sandboxed worker (each `--in` file is
  placed in its scratch first, under its base name, through the session files API); output
  streams live; denials print in a block; the images and files the run produced are written
  to `--out` (`cli_out.py`). Exit statuses (also in the README): 0 the code completed and
  nothing was refused; 1 the code raised (or learning could not make, write or apply a
  proposal); 2 a policy refusal or a limit; 64 a usage error; 66 an input file that cannot
  be read; 69 a provider that cannot run here; 70 the worker failed; 78 a policy that does
  not load; 130 interrupted. Under `--json` every error is a JSON object on stdout too.
* `policy check FILE` / `policy explain FILE`: validate a policy / summarise it.
* further commands register themselves through `_COMMAND_MODULES` (each module exposes
  `add_parser(subparsers)` and sets `func` on its parser).

Colour is used only when stdout is a terminal and `NO_COLOR` is unset.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from agent_sandbox._errors import SandboxError

__all__ = ["Style", "main"]

#: Modules that add their own sub-commands (`add_parser(subparsers)`).
_COMMAND_MODULES: tuple[str, ...] = (
    "agent_sandbox._tools.cli_demo",
    "agent_sandbox._tools.cli_doctor",
    "agent_sandbox._tools.cli_learn",
    "agent_sandbox._tools.cli_qemu",
    "agent_sandbox._tools.cli_worker",
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_DENIED = 2
EXIT_USAGE = 64
EXIT_NOINPUT = 66
EXIT_UNAVAILABLE = 69
EXIT_SOFTWARE = 70
EXIT_CONFIG = 78
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on their own exit status (argparse's 2 is our refusal)."""

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _version() -> str:
    from importlib import metadata

    from agent_sandbox._errors import DIST_NAME

    try:
        return f"{DIST_NAME} {metadata.version(DIST_NAME)}"
    except metadata.PackageNotFoundError:
        return f"{DIST_NAME} (not installed as a distribution)"


class Style:
    """ANSI styling that switches itself off when the stream is not a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.enabled = stream.isatty() and "NO_COLOR" not in os.environ

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def red(self, text: str) -> str:
        return self._wrap("31", text)

    def yellow(self, text: str) -> str:
        return self._wrap("33", text)

    def green(self, text: str) -> str:
        return self._wrap("32", text)

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def dim(self, text: str) -> str:
        return self._wrap("2", text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="agent-sandbox",
        description="Run Python in a sandboxed worker under a declared policy.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="run code in a sandboxed worker")
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("-c", dest="code", metavar="CODE", help="the code to run")
    src.add_argument("file", nargs="?", help="a Python file to run ('-' for stdin)")
    run.add_argument(
        "--policy",
        "-p",
        default=None,
        help="a shipped policy name or a TOML file (default: pure-computation)",
    )
    run.add_argument("--provider", default=None, help="override the policy's provider")
    run.add_argument(
        "--timeout", type=_positive_seconds, default=None, help="wall-clock seconds (> 0)"
    )
    run.add_argument("--json", action="store_true", help="print the result as one JSON object")
    run.add_argument(
        "--out",
        default=".",
        metavar="DIR",
        help="write the images and files the run produced here (default: the working "
        "directory); never over an existing file without --force",
    )
    run.add_argument(
        "--force", action="store_true", help="let --out replace existing files (never links)"
    )
    run.add_argument(
        "--no-out", action="store_true", help="write nothing; list what the run produced"
    )
    run.add_argument(
        "--in",
        dest="inputs",
        action="append",
        default=[],
        metavar="FILE",
        help="place FILE in the worker's scratch (its working directory) under its base name "
        "before the run (repeatable; bounded by limits.transfer_mb; a refusal exits with 2)",
    )
    run.set_defaults(func=_cmd_run)

    policy = sub.add_parser("policy", help="check or explain a policy")
    psub = policy.add_subparsers(dest="policy_command", metavar="ACTION")
    check = psub.add_parser("check", help="validate a policy file")
    check.add_argument("file")
    check.set_defaults(func=_cmd_policy_check)
    explain = psub.add_parser("explain", help="summarise what a policy allows")
    explain.add_argument("file")
    explain.set_defaults(func=_cmd_policy_explain)
    lst = psub.add_parser("list", help="list the shipped policies")
    lst.set_defaults(func=_cmd_policy_list)
    policy.set_defaults(func=lambda args: _usage(policy))

    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    # Every string from a worker is valid text by the time the host sees it (a lone
    # surrogate becomes U+FFFD in the intake); a terminal whose encoding cannot show a
    # character still gets an escape, never a crash.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(func(args))
    except SandboxError as exc:
        code = _exit_status(exc)
        if getattr(args, "json", False):
            print(
                dump_json(
                    {
                        "error": {
                            "type": type(exc).__name__,
                            "message": str(exc),
                            "exit_status": code,
                        }
                    }
                )
            )
        else:
            style = Style(sys.stderr)
            print(style.red(f"error: {exc}"), file=sys.stderr)
        return code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, as other command-line tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _exit_status(exc: SandboxError) -> int:
    """The documented exit status for a failure outside the user's code."""
    from agent_sandbox._errors import (
        FileTransferRefused,
        LearningError,
        PolicyError,
        PolicyNotFound,
        ProviderUnavailable,
    )

    if isinstance(exc, LearningError):
        return EXIT_ERROR
    if isinstance(exc, FileTransferRefused):
        return EXIT_DENIED
    if isinstance(exc, InputFileError):
        return EXIT_NOINPUT
    if isinstance(exc, ProviderUnavailable):
        return EXIT_UNAVAILABLE
    if isinstance(exc, PolicyError | PolicyNotFound):
        return EXIT_CONFIG
    return EXIT_SOFTWARE


class InputFileError(SandboxError):
    """The file named on the command line cannot be read."""


# -- run ---------------------------------------------------------------------------------


def _read_source(args: argparse.Namespace) -> str:
    if args.code is not None:
        return str(args.code)
    if args.file == "-":
        return sys.stdin.read()
    try:
        with open(args.file, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise InputFileError(f"cannot read {args.file}: {exc.strerror}") from None


def _cmd_run(args: argparse.Namespace) -> int:
    from agent_sandbox._host.sandbox import Sandbox

    code = _read_source(args)
    out, err = sys.stdout, sys.stderr

    def live(kind: str, data: Any) -> None:
        if args.json:
            return
        if kind == "stdout":
            out.write(data)
            out.flush()
        elif kind == "stderr":
            err.write(data)
            err.flush()

    filename = None if args.code is not None or args.file == "-" else str(args.file)
    from agent_sandbox._tools.cli_out import collect, write_outputs

    inputs = _input_files(args.inputs)
    with Sandbox(args.policy, provider=args.provider, warm=0, tool="cli") as sandbox:
        # One session of this run alone: the files, the code and the read-back of what it
        # wrote need one interpreter.
        session = sandbox.session("cli")
        for name, path in inputs:
            session.put_file(name, source=path)
        result = session.run(
            code,
            timeout=args.timeout,
            on_event=live,
            timeout_source="the --timeout option",
            filename=filename,
        )
        outputs = (
            collect(result, skip={name for name, _ in inputs})
            if (result.images or result.files)
            else []
        )
    if not args.no_out:
        write_outputs(outputs, args.out, force=args.force)
    if args.json:
        data = json.loads(result.to_json())
        data["outputs"] = [
            {"name": o.name, "kind": o.kind, "path": o.path or None, "not_returned": o.reason}
            for o in outputs
        ]
        print(json.dumps(data, ensure_ascii=False))
    else:
        print_result_tail(result, sys.stderr)
        print_outputs(outputs, sys.stderr, written=not args.no_out)
    return exit_code(result)


def print_outputs(outputs: Any, stream: TextIO, *, written: bool) -> None:
    """List what the run produced: where each was written, or why it was not (names quoted)."""
    from agent_sandbox._render import clean, quote

    style = Style(stream)
    for o in outputs:
        if o.path:
            print(
                style.green("wrote ") + f"{quote(o.path)} ({o.kind} {quote(o.name)})", file=stream
            )
        elif o.data is not None and not written:
            print(f"produced {o.kind} {quote(o.name)} ({len(o.data)} bytes)", file=stream)
        else:
            why = clean(o.reason or "not written", 300)
            print(style.yellow(f"not returned: {o.kind} {quote(o.name)}: {why}"), file=stream)


def _input_files(paths: Sequence[str]) -> list[tuple[str, str]]:
    """(scratch name, host path) for each `--in`; an unreadable file or two files of one
    base name are input errors (exit 66), before any worker starts."""
    out: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    for path in paths:
        name = os.path.basename(os.path.normpath(path))
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise InputFileError(f"--in {path}: not a readable file")
        if name in seen:
            raise InputFileError(
                f"--in {path}: {seen[name]} has the same base name {name!r}; rename one"
            )
        seen[name] = path
        out.append((name, path))
    return out


def exit_code(result: Any) -> int:
    """0: completed with no refusal of the code's own; 2: a refusal was the code's (caught or
    not; library-internal ones do not count); 1: any other failure."""
    if result.user_denials() or (result.error is not None and result.error.kind == "denied"):
        return EXIT_DENIED
    return EXIT_OK if result.error is None else EXIT_ERROR


def print_result_tail(result: Any, stream: TextIO) -> None:
    """Print the value, the error and a block of the code's refusals after the live output.

    Every piece of data (targets, details, tracebacks) is escaped: nothing the code or the
    worker wrote can move the cursor, colour the terminal or forge a line of this block.
    """
    from agent_sandbox._render import clean, clean_block, quote

    style = Style(stream)
    if result.value is not None:
        print(style.dim("value: ") + clean(result.value_text(), 10_000), file=stream)
    for notice in result.notices:
        print(style.yellow(f"note: {clean(notice, 1000)}"), file=stream)
    user = result.user_denials()
    if result.error is not None:
        err = result.error
        if err.traceback and err.kind in ("exception", "syntax", "denied"):
            text = clean_block(err.traceback)
            stream.write(text if text.endswith("\n") else text + "\n")
        elif not (err.rule and any(d.rule == err.rule for d in result.denials)):
            # A refusal is shown once, in the block below; other failures are shown here.
            label = f"{err.kind}" + (f" [{clean(err.rule, 60)}]" if err.rule else "")
            print(style.red(f"{label}: {clean(err.message, 2000)}"), file=stream)
    shown = [d for d in result.denials if not d.internal]
    if shown:
        print(style.bold(style.red(f"denied ({sum(d.count for d in shown)}):")), file=stream)
        for d in shown:
            times = f" ({d.count} times)" if d.count > 1 else ""
            where = " [between calls]" if d.origin == "between-calls" else ""
            line = f"{clean(d.action, 40)} {quote(d.target)}{times}{where}"
            print(style.red(f"  [{clean(d.rule, 60)}] ") + line, file=stream)
            if d.detail:
                print(style.dim(f"      {clean(d.detail)}"), file=stream)
            if d.hint.startswith("[[grant]]"):
                print(style.green("      to allow it, add to the policy file:"), file=stream)
                for hint_line in d.hint.splitlines():
                    print(style.green(f"        {clean(hint_line, 2000)}"), file=stream)
            elif d.hint:
                print(style.green(f"      to allow it: {clean(d.hint)}"), file=stream)
    internal = result.internal_denials()
    if internal and not user:
        count = sum(d.count for d in internal)
        print(
            style.dim(
                f"({count} refusal(s) inside library code were handled by the library; "
                "the code was not affected. --json lists them.)"
            ),
            file=stream,
        )
    elif internal:
        more = sum(d.count for d in internal)
        print(style.dim(f"({more} more inside library code)"), file=stream)


# -- policy ------------------------------------------------------------------------------


def _cmd_policy_check(args: argparse.Namespace) -> int:
    from agent_sandbox._host.boundary import NO_BOUNDARY, resolve_boundary
    from agent_sandbox.policies import resolve_policy
    from agent_sandbox.providers._masks import policy_file_warnings

    policy = resolve_policy(args.file)
    # The provider is part of the check: unknown, missing here, or unable to serve the policy.
    boundary = resolve_boundary(policy)
    style = Style(sys.stdout)
    print(style.green("ok: ") + f"{policy.name} (fingerprint {policy.fingerprint()})")
    if boundary.name == NO_BOUNDARY:
        print(style.yellow(f"provider {policy.provider}: no kernel boundary (explicit opt-out)"))
    else:
        print(f"provider {policy.provider}: {boundary.name}")
    for warning in policy_file_warnings(policy):
        print(style.yellow("warning: ") + warning)
    return EXIT_OK


def _cmd_policy_explain(args: argparse.Namespace) -> int:
    from agent_sandbox.policies import resolve_policy

    print(resolve_policy(args.file).explain())
    return EXIT_OK


def _cmd_policy_list(args: argparse.Namespace) -> int:
    from agent_sandbox.policies import list_presets, resolve_policy

    for name in list_presets():
        policy = resolve_policy(name)
        print(f"{name:24} {policy.description}")
    return EXIT_OK


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False)
