"""`agent-sandbox learn` and `agent-sandbox policy diff|apply`: learning mode on the command line.

* `learn (-c CODE | FILE) --policy P [--provider X] [--out DIR]` runs the code once in the
  learning envelope of P (the envelope is printed first), then writes `<P>.proposed.toml` and
  `<P>.proposed.diff` beside P (or in DIR) and prints the diff. P itself is never changed.
* `policy diff CURRENT PROPOSED` prints what the proposal adds or removes, with its RISKY marks.
* `policy apply PROPOSED [--to CURRENT] [--yes]` shows the diff and adds its grants to
  CURRENT only after a `y` on standard input, or with `--yes` (CURRENT keeps every byte; a
  `[[grant]]` is appended).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from agent_sandbox._tools.cli import EXIT_ERROR, EXIT_OK, Style, print_result_tail

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `learn`, and `diff`/`apply` under the existing `policy` command."""
    learn = sub.add_parser(
        "learn",
        help="run code in learning mode and write a proposed policy beside the current one",
        description="Run code once in the learning envelope of a policy (kernel provider when "
        "available, writes only to scratch and the declared paths, network as declared, secrets "
        "withheld) and write <policy>.proposed.toml and <policy>.proposed.diff for review.",
    )
    src = learn.add_mutually_exclusive_group(required=True)
    src.add_argument("-c", dest="code", metavar="CODE", help="the code to run")
    src.add_argument("file", nargs="?", help="a Python file to run ('-' for stdin)")
    learn.add_argument("--policy", "-p", required=True, help="the policy file to learn for")
    learn.add_argument("--provider", default=None, help="the provider (default: auto)")
    learn.add_argument("--timeout", type=float, default=None, help="wall-clock seconds")
    learn.add_argument("--out", default=None, help="write the proposal here, not beside P")
    learn.set_defaults(func=_cmd_learn)

    policy = sub.choices.get("policy")
    if policy is None:
        return
    psub = next(
        (a for a in policy._actions if isinstance(a, argparse._SubParsersAction)),
        None,
    )
    if psub is None:
        return
    diff = psub.add_parser("diff", help="show what a proposed policy changes")
    diff.add_argument("current", help="the current policy (file or shipped name)")
    diff.add_argument("proposed", help="the proposed policy file")
    diff.set_defaults(func=_cmd_policy_diff)
    apply = psub.add_parser("apply", help="add what a reviewed proposal grants to a policy file")
    apply.add_argument("proposed", help="the proposed policy file (<name>.proposed.toml)")
    apply.add_argument(
        "--to",
        default=None,
        help="the policy file the grants are added to, as [[grant]] elements appended at "
        "its end; nothing in it is replaced or removed (default: <name>.toml)",
    )
    apply.add_argument("--yes", "-y", action="store_true", help="apply without asking")
    apply.set_defaults(func=_cmd_policy_apply)


def _cmd_learn(args: argparse.Namespace) -> int:
    from agent_sandbox._tools.cli import _read_source
    from agent_sandbox._tools.learn.observe import learn_run
    from agent_sandbox._tools.learn.review import write_proposal

    code = _read_source(args)
    err = sys.stderr
    style = Style(err)

    def live(kind: str, data: Any) -> None:
        if kind == "stdout":
            sys.stdout.write(data)
            sys.stdout.flush()
        elif kind == "stderr":
            err.write(data)
            err.flush()

    from agent_sandbox._tools.learn.observe import envelope_report, learning_envelope
    from agent_sandbox.policies import resolve_policy

    current = resolve_policy(args.policy)
    if args.out is None and (not current.source or current.source.startswith("preset:")):
        from agent_sandbox._errors import LearningError

        raise LearningError(
            f"{args.policy!r} is a shipped policy, not a file: copy it to a file first, "
            "or give --out DIR for the proposal"
        )
    envelope = learning_envelope(current, provider=args.provider)
    print(style.bold("learning envelope:"), file=err)
    for line in envelope_report(current, envelope):
        print(f"  {line}", file=err)
    run = learn_run(code, current, provider=envelope.provider, timeout=args.timeout, on_event=live)
    print_result_tail(run.result, err)
    if run.result.provider:
        print(style.bold("learning envelope: ") + run.report[-1], file=err)
    files = write_proposal(run.proposal, out_dir=args.out, expect_digest=run.digest or None)
    print(run.proposal.diff(), end="")
    print(style.green("proposal written: ") + f"{files.toml}", file=err)
    print(style.green("diff written:     ") + f"{files.diff}", file=err)
    if run.proposal.risky:
        print(style.yellow(f"{len(run.proposal.risky)} RISKY entries: review them"), file=err)
    print(
        style.dim(f"nothing is in force until: agent-sandbox policy apply {files.toml}"), file=err
    )
    return EXIT_OK


def _cmd_policy_diff(args: argparse.Namespace) -> int:
    from agent_sandbox._tools.learn.review import diff_files

    print(diff_files(args.current, args.proposed), end="")
    return EXIT_OK


def _cmd_policy_apply(args: argparse.Namespace) -> int:
    from agent_sandbox._errors import LearningError
    from agent_sandbox._tools.learn.review import apply_proposal, diff_files

    proposed = str(args.proposed)
    target = args.to
    if target is None:
        if not proposed.endswith(".proposed.toml"):
            raise LearningError(
                "cannot tell which policy this proposal is for; give --to", path=proposed
            )
        target = proposed[: -len(".proposed.toml")] + ".toml"
    style = Style(sys.stderr)
    if os.path.lexists(target):
        print(diff_files(target, proposed), end="")
    else:
        print(f"{target} does not exist yet; it will be created from {proposed}")
    if not args.yes:
        print(
            f"Add what this proposal grants to {target}? [y/N] ",
            end="",
            file=sys.stderr,
            flush=True,
        )
        answer = sys.stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            print(style.yellow("not applied"), file=sys.stderr)
            return EXIT_ERROR
    written = apply_proposal(proposed, target)
    print(style.green("applied: ") + f"{written}", file=sys.stderr)
    return EXIT_OK
