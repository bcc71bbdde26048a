"""Listings list: every documented grant form of a directory lets the code list what it may
read, shows nothing else, and agrees across `glob`, `os.scandir`, `os.listdir`,
`Path.glob`, `Path.iterdir`, `os.walk` and pandas, under every kernel provider.

The forms (docs/policies.md): `dir`, `dir/`, `dir/**`, `dir/*.csv`. With the Python layer
on, a listing shows exactly the entries the grant covers (or that lead to one), never a
hidden or denied name; with it off (native code: `open(O_DIRECTORY)` and `getdents` on the
descriptor), the kernel keeps the content of what a pattern leaves out unreadable (its name
may still be listed: see docs/policies.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent_sandbox import Policy, Sandbox
from agent_sandbox.policies._load import policy_from_dict
from tests.providers.conftest import (
    KERNEL_PROVIDERS,
    NATIVE,
    accepted_for,
    hostile_policy,
    skip_unless_available,
)

FORMS = ("dir", "dir/", "dir/**", "dir/*.csv")

#: What each form lets the code see in `sales/` (listing) and under it (walk).
EXPECTED: dict[str, dict[str, Any]] = {
    "whole": {
        "glob_csv": ["q1.csv", "q2.csv"],
        "listdir": ["notes.txt", "q1.csv", "q2.csv", "sub"],
        "walk": [[".", ["notes.txt", "q1.csv", "q2.csv"]], ["sub", ["q3.csv"]]],
        "pandas": [1, 1],
    },
    "csv": {
        "glob_csv": ["q1.csv", "q2.csv"],
        "listdir": ["q1.csv", "q2.csv"],
        "walk": [[".", ["q1.csv", "q2.csv"]]],
        "pandas": [1, 1],
    },
}

LISTINGS = r"""
import glob, json, os, pathlib
import pandas as pd
D = {sales!r}
def names(items):
    return sorted(os.path.basename(str(p)) for p in items)
out = {{
    "glob_csv": names(glob.glob(D + "/*.csv")),
    "glob_all": names(glob.glob(D + "/*")),
    "listdir": sorted(os.listdir(D)),
    "scandir": sorted(e.name for e in os.scandir(D)),
    "path_glob": names(pathlib.Path(D).glob("*.csv")),
    "iterdir": names(pathlib.Path(D).iterdir()),
    "walk": sorted([os.path.relpath(r, D), sorted(f)] for r, d, f in os.walk(D)),
    "isdir": os.path.isdir(D),
    "pandas": [len(pd.read_csv(p)) for p in sorted(glob.glob(D + "/*.csv"))],
}}
print(json.dumps(out))
"""


@pytest.fixture
def sales(tmp_path: Path) -> Path:
    """`data/sales` with two CSV files, a note, a hidden `.env`, a subdirectory, and a
    sibling directory no form grants."""
    data = tmp_path / "data"
    sales = data / "sales"
    (sales / "sub").mkdir(parents=True)
    (data / "other").mkdir()
    for name in ("q1.csv", "q2.csv", "sub/q3.csv"):
        (sales / name).write_text("a,b\n1,2\n")
    (sales / "notes.txt").write_text("secret-notes\n")
    (sales / ".env").write_text("KEY=secret-env\n")
    (data / "other" / "o.txt").write_text("secret-other\n")
    for d in (tmp_path, data, sales, sales / "sub", data / "other"):
        d.chmod(0o777)
    return sales


def _entry(sales: Path, form: str) -> str:
    return {"dir": str(sales), "dir/": f"{sales}/", "dir/**": f"{sales}/**"}.get(
        form, f"{sales}/*.csv"
    )


def _policy(sales: Path, form: str, provider: str) -> Policy:
    return policy_from_dict(
        {
            "name": "listings",
            "extends": "data-analysis",
            "provider": provider,
            **accepted_for(provider),
            "files": {"read": [_entry(sales, form)]},
            "imports": {"allow": ["os", "glob", "pathlib", "json", "pandas", "numpy"]},
        }
    )


@pytest.mark.parametrize("provider", KERNEL_PROVIDERS)
def test_every_grant_form_lists_what_it_grants_and_nothing_else(provider: str, sales: Path) -> None:
    """It lists, under each form, exactly what the form grants (no `.env`, nothing beside a
    pattern), with every listing API agreeing, and no refusal: the code got what it asked."""
    skip_unless_available(provider)
    seen: dict[str, Any] = {}
    for form in FORMS:
        with Sandbox(_policy(sales, form, provider), warm=0) as sandbox:
            result = sandbox.run(LISTINGS.format(sales=str(sales)))
        assert result.error is None, (form, result.error)
        got = json.loads(result.stdout)
        want = EXPECTED["csv" if form == "dir/*.csv" else "whole"]
        assert got["glob_csv"] == got["path_glob"] == want["glob_csv"], form
        assert got["listdir"] == got["scandir"] == got["iterdir"] == want["listdir"], form
        assert got["glob_all"] == [n for n in want["listdir"] if not n.startswith(".")], form
        assert got["walk"] == want["walk"] and got["isdir"] is True, form
        assert got["pandas"] == want["pandas"], form
        assert ".env" not in got["listdir"], form
        # No refusal of anything under the grant: the code got what it asked for. (A
        # library's own probe elsewhere, such as /proc/sys/vm/overcommit_memory read at
        # import under unshare, is not this test's business.)
        assert not [d for d in result.user_denials() if str(sales.parent) in d.target], form
        seen[form] = got
    assert seen["dir"] == seen["dir/"] == seen["dir/**"]


def test_a_listing_glob_swallowed_is_reported_as_the_codes_refusal(sales: Path) -> None:
    """It reports a refused listing that `glob`, `Path.glob` and `os.walk` turned into an
    empty result as the code's refusal (the code got less), not as library noise."""
    with Sandbox(_policy(sales, "dir/**", "auto"), warm=0) as sandbox:
        result = sandbox.run(
            f"import glob, os, pathlib\nD = {str(sales.parent)!r}\n"
            "print(glob.glob(D + '/*'), list(pathlib.Path(D).glob('*')), list(os.walk(D)))"
        )
    assert result.stdout == "[] [] []\n"
    user = result.user_denials()
    assert [(d.rule, d.action, d.target) for d in user] == [
        ("files.read", "list", str(sales.parent))
    ]
    assert user[0].count == 3


NATIVE_PROBE = (
    NATIVE
    + r"""
import json
D = {sales!r}
def nlist(p):
    fd = nopen(p, os.O_RDONLY | os.O_DIRECTORY)
    if fd < 0:
        return fd
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)
out = {{
    "list": nlist(D),
    "q1": nread(D + "/q1.csv"),
    "notes": nread(D + "/notes.txt"),
    "q3": nread(D + "/sub/q3.csv"),
    "env": nread(D + "/.env"),
    "other": nread(os.path.dirname(D) + "/other/o.txt"),
}}
print(json.dumps(out))
"""
)


@pytest.mark.parametrize("provider", KERNEL_PROVIDERS)
@pytest.mark.parametrize("form", FORMS)
def test_blocks_native_reads_beside_a_pattern_grant(
    provider: str, form: str, sales: Path, tmp_path: Path
) -> None:
    """It denies native code (Python layer off) the content of what a grant does not cover:
    beside a pattern (`notes.txt`, `sub/`), a hidden `.env`, a sibling directory; and lets
    it read and list what the grant covers."""
    skip_unless_available(provider)
    arena = {"ro": sales, "rw": tmp_path / "rw", "root": tmp_path}
    (tmp_path / "rw").mkdir(exist_ok=True)
    policy = hostile_policy(
        arena, provider=provider, files={"read": [_entry(sales, form)], "write": []}
    )
    with Sandbox(policy, warm=0) as sandbox:
        result = sandbox.run(NATIVE_PROBE.format(sales=str(sales)))
    assert result.error is None, result.error
    got = json.loads(result.stdout)
    assert got["q1"] == "a,b\n1,2\n"  # the attack harness ran and reads what is granted
    assert "q1.csv" in got["list"]
    for key in ("env", "other"):
        assert "secret" not in str(got[key]), (key, got)
    if form == "dir/*.csv":
        assert "secret" not in str(got["notes"]) and "a,b" not in str(got["q3"]), got
    else:
        assert got["notes"] == "secret-notes\n" and got["q3"] == "a,b\n1,2\n"
