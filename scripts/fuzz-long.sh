#!/usr/bin/env bash
# Long fuzz runs of every host-side reader (tests/fuzz/harnesses.py), then the grown corpus
# replayed and mutated against ASan and UBSan builds of the C extension. Usage:
#
#   bash scripts/fuzz-long.sh [SECONDS_PER_HARNESS] [HARNESS ...]     (default 600, all)
#
# Phase 1, per harness: atheris (coverage-guided libFuzzer) on the ordinary build for
# SECONDS_PER_HARNESS, growing a working copy of tests/fuzz/corpus/NAME.
# Phase 2, per harness: agent_sandbox/_host/intake/_fastscan.c built with -fsanitize=address,undefined (gcc or
# clang) and loaded in its place, libasan preloaded; the grown corpus is replayed, then
# mutated at random (seeded) for the same CPU time. Phase 2 does not use libFuzzer: with
# libasan preloaded, the sanitizer's coverage symbols shadow libFuzzer's and the Python
# coverage feedback breaks (atheris's `using_sanitizers.md`), so the guidance comes from
# the corpus phase 1 grew.
# Prints per harness and phase: executions, CPU seconds, peak RSS, artefacts. New inputs
# stay in the work folder it names at the end; copy the interesting ones into
# tests/fuzz/corpus/NAME by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SECONDS_EACH=${1:-600}
shift || true
NAMES=("$@")
if [ ${#NAMES[@]} -eq 0 ]; then
  NAMES=(fastscan unpickle events remote_transport guard_block serve_relay)
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/agent-sandbox-fuzz.XXXXXX")
CC=${CC:-$(command -v clang || command -v gcc)}
INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
mkdir -p "$WORK/lib/agent_sandbox/_host/intake"
"$CC" -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
  -fno-sanitize-recover=undefined -I"$INC" agent_sandbox/_host/intake/_fastscan.c \
  -o "$WORK/lib/agent_sandbox/_host/intake/_fastscan$SUFFIX"
ASAN_LIB=$("$CC" -print-file-name=libasan.so)
# The sanitized module must win over the installed one: a finder placed first loads it.
cat >"$WORK/lib/sitecustomize.py" <<PYEOF
import importlib.util, sys
_spec = importlib.util.spec_from_file_location(
    "agent_sandbox._host.intake._fastscan", "$WORK/lib/agent_sandbox/_host/intake/_fastscan$SUFFIX")
class _Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return _spec if name == "agent_sandbox._host.intake._fastscan" else None
sys.meta_path.insert(0, _Finder)
PYEOF
SANITIZED=(env LD_PRELOAD="$ASAN_LIB" PYTHONPATH="$WORK/lib" FUZZ_REQUIRE_FASTSCAN=1
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1)
# The sanitized build must be the one the harnesses import.
"${SANITIZED[@]}" "$PY" -c \
  "from agent_sandbox._host.intake import _fastscan; assert _fastscan.__file__.startswith('$WORK'), _fastscan.__file__"
report() {  # name phase folder rc
  local execs user sys rss found
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$3/log" | tail -n1)
  read -r user sys rss <"$3/time" || true
  found=$(find "$3/artifacts" -type f 2>/dev/null | wc -l)
  printf '%-17s %-9s rc=%s executions=%s cpu=%ss (user %s + sys %s) peak_rss=%sKiB artefacts=%s\n' \
    "$1" "$2" "$4" "${execs:-?}" "$(awk "BEGIN{print ${user:-0} + ${sys:-0}}")" \
    "${user:-?}" "${sys:-?}" "${rss:-?}" "$found"
}
for name in "${NAMES[@]}"; do
  dir="$WORK/$name"
  mkdir -p "$dir/corpus" "$dir/guided/artifacts" "$dir/sanitized/artifacts"
  cp tests/fuzz/corpus/"$name"/* "$dir/corpus/"
  set +e
  FUZZ_REQUIRE_FASTSCAN=1 /usr/bin/time -f "%U %S %M" -o "$dir/guided/time" \
    "$PY" tests/fuzz/run.py "$name" "$dir/corpus" -max_total_time="$SECONDS_EACH" \
    -timeout=20 -rss_limit_mb=4000 -print_final_stats=1 \
    -artifact_prefix="$dir/guided/artifacts/" >"$dir/guided/log" 2>&1
  rc=$?
  set -e
  report "$name" guided "$dir/guided" "$rc"
  set +e
  /usr/bin/time -f "%U %S %M" -o "$dir/sanitized/time" "${SANITIZED[@]}" \
    "$PY" tests/fuzz/run.py replay "$name" "$dir/corpus" "$SECONDS_EACH" \
    "$dir/sanitized/artifacts" >"$dir/sanitized/log" 2>&1
  rc=$?
  set -e
  report "$name" sanitized "$dir/sanitized" "$rc"
done
echo "work folder (logs, grown corpora, artefacts): $WORK"
