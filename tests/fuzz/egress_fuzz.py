"""Fuzz the egress proxy's parsers with atheris (coverage-guided), growing the corpus that
`test_egress_parsers.py` replays.

    .venv/bin/python tests/fuzz/egress_fuzz.py egress_head -max_total_time=600 \\
        tests/fuzz/corpus/egress_head

(`egress_socks`, `egress_host`, `egress_exchange` likewise). `egress_all` runs the four in
one process (the first byte of an input picks the target, in `egress_targets._ALL`'s
order), for one long run:

    nice -n 10 .venv/bin/python tests/fuzz/egress_fuzz.py egress_all WORK \
        -max_total_time=3600 -max_len=20000 -timeout=20 -rss_limit_mb=2000

seeded with each corpus file prefixed by its target's byte; new inputs go back into
`tests/fuzz/corpus/<target>` without that byte. Prints libFuzzer's own figures; the CPU time is
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
    target = {**egress_targets.TARGETS, **egress_targets.COMBINED}[name]
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
