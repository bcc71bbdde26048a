"""Fuzz the egress proxy's parsers with atheris (coverage-guided), growing the corpus that
`test_egress_parsers.py` replays.

    .venv/bin/python tests/fuzz/egress_fuzz.py egress_head -max_total_time=600 \\
        tests/fuzz/corpus/egress_head

(`egress_socks`, `egress_host` likewise). Prints libFuzzer's own figures; the CPU time is
the process's (`/usr/bin/time -v`).
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(__file__))
with atheris.instrument_imports():
    import egress_targets


def main() -> None:
    name = sys.argv.pop(1)
    target = egress_targets.TARGETS[name]
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
