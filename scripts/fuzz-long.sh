#!/usr/bin/env bash
# Long fuzz runs of every host-side reader (tests/fuzz/harnesses.py) with the C extensions
# built with AddressSanitizer and UndefinedBehaviorSanitizer. Usage:
#
#   bash scripts/fuzz-long.sh [SECONDS_PER_HARNESS] [HARNESS ...]     (default 600, all)
#
# It builds guards/_fastscan.c into a private folder with -fsanitize=address,undefined
# (gcc or clang), runs each harness under atheris with that build first on the import path
# and libasan preloaded, against a working copy of tests/fuzz/corpus/NAME (new inputs stay
# in the work folder; copy the interesting ones into the committed corpus by hand), and
# prints per harness: executions, CPU seconds, peak RSS and any crash or leak artefact.
# Nothing is left behind but the work folder it names at the end.
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
mkdir -p "$WORK/lib/agent_sandbox/guards"
"$CC" -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
  -fno-sanitize-recover=undefined -I"$INC" guards/_fastscan.c \
  -o "$WORK/lib/agent_sandbox/guards/_fastscan$SUFFIX"
ASAN_LIB=$("$CC" -print-file-name=libasan.so)
# The sanitized module must win over the installed one: a path hook loads it first.
cat >"$WORK/lib/sitecustomize.py" <<PYEOF
import importlib.machinery, importlib.util, sys
_spec = importlib.util.spec_from_file_location(
    "agent_sandbox.guards._fastscan", "$WORK/lib/agent_sandbox/guards/_fastscan$SUFFIX")
class _Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return _spec if name == "agent_sandbox.guards._fastscan" else None
sys.meta_path.insert(0, _Finder)
PYEOF
for name in "${NAMES[@]}"; do
  mkdir -p "$WORK/$name/corpus" "$WORK/$name/artifacts"
  cp tests/fuzz/corpus/"$name"/* "$WORK/$name/corpus/"
  set +e
  /usr/bin/time -f "%U %S %M" -o "$WORK/$name/time" env \
    LD_PRELOAD="$ASAN_LIB" PYTHONPATH="$WORK/lib" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$PY" tests/fuzz/run.py "$name" "$WORK/$name/corpus" -max_total_time="$SECONDS_EACH" \
    -timeout=20 -rss_limit_mb=4000 -print_final_stats=1 \
    -artifact_prefix="$WORK/$name/artifacts/" >"$WORK/$name/log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$WORK/$name/log" | tail -n1)
  read -r user sys rss <"$WORK/$name/time" || true
  found=$(ls "$WORK/$name/artifacts" | wc -l)
  printf '%-17s rc=%s executions=%s cpu=%.1fs (user %s + sys %s) peak_rss=%sKiB artefacts=%s\n' \
    "$name" "$rc" "${execs:-?}" "$(awk "BEGIN{print ${user:-0} + ${sys:-0}}")" "${user:-?}" "${sys:-?}" \
    "${rss:-?}" "$found"
done
echo "work folder (logs, grown corpora, artefacts): $WORK"
