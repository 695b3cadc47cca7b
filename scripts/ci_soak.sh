#!/usr/bin/env bash
# Soak the Ray-backed suites the way CI meets them: N fresh clones of this checkout's HEAD, each
# running tests/deployments and tests/k8s with PYTHONPATH on the clone (so the clone's code wins over
# the venv's editable install, in Ray's workers too). One tally line per run, then a summary.
#
#   scripts/ci_soak.sh [N=10]
#   VENV=path/to/venv        venv to use (default: this checkout's .venv; in a git worktree
#                            without one, the main checkout's .venv)
#   SUITES="tests/deployments tests/k8s"   what each run runs
#   RUN_TIMEOUT=1800         seconds one run may take (then it counts as failed)
#   SOAK_TIMEOUT=21600       seconds for the whole soak (later runs are not started)
#   KEEP=1                   keep every clone (failed runs' clones are always kept)
#
# Exit status 0 only if every run passed with no failures and no errors.
set -uo pipefail

N="${1:-10}"
SUITES="${SUITES:-tests/deployments tests/k8s}"
RUN_TIMEOUT="${RUN_TIMEOUT:-1800}"
SOAK_TIMEOUT="${SOAK_TIMEOUT:-21600}"

SRC="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
SHA="$(git -C "$SRC" rev-parse HEAD)"
if [[ -z "${VENV:-}" ]]; then
  VENV="$SRC/.venv"
  if [[ ! -x "$VENV/bin/python" ]]; then  # a worktree: the main checkout holds the venv
    common="$(cd "$SRC" && cd "$(git rev-parse --git-common-dir)" && pwd)"
    VENV="$(dirname "$common")/.venv"
  fi
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "no venv at $VENV (run make install, or set VENV=...)" >&2
  exit 2
fi
if [[ -n "$(git -C "$SRC" status --porcelain --untracked-files=no)" ]]; then
  echo "warning: $SRC has uncommitted changes; the clones test HEAD ($SHA) without them" >&2
fi

BASE="$(mktemp -d -t molora-soak.XXXXXX)"
# The checkout's neighbour shared/ (the KubeRay CRD the manifest tests read) beside the clones too.
[[ -e "$(dirname "$SRC")/shared" ]] && ln -s "$(dirname "$SRC")/shared" "$BASE/shared"
echo "soak: $N runs of '$SUITES' at ${SHA:0:12}, venv $VENV, clones under $BASE"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
start_all=$SECONDS
declare -a TALLY=()
ok_runs=0

count() {  # count <word> <pytest summary line>: the number before "<word>" (0 if none)
  local n
  n="$(grep -oE "[0-9]+ $1" <<<"$2" | head -1 | cut -d' ' -f1)"
  echo "${n:-0}"
}

for i in $(seq 1 "$N"); do
  if (( SECONDS - start_all > SOAK_TIMEOUT )); then
    TALLY+=("run $i: not started (SOAK_TIMEOUT=${SOAK_TIMEOUT}s reached)")
    continue
  fi
  dir="$BASE/run$i"
  t0=$SECONDS
  if ! git clone --quiet --no-checkout "$SRC" "$dir" || ! git -C "$dir" checkout --quiet --detach "$SHA"; then
    TALLY+=("run $i: clone failed")
    echo "${TALLY[-1]}"
    continue
  fi
  log="$dir/soak.log"
  # shellcheck disable=SC2086  # SUITES is a list of paths
  (cd "$dir" && PYTHONPATH="$dir" timeout -k 30 "$RUN_TIMEOUT" "$VENV/bin/python" -m pytest -q \
    -p no:cacheprovider $SUITES) >"$log" 2>&1
  rc=$?
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran' "$log" | tail -1)"
  passed="$(count passed "$summary")"
  failed="$(count failed "$summary")"
  errors="$(count error "$summary")"
  skipped="$(count skipped "$summary")"
  note=""
  (( rc == 124 || rc == 137 )) && note=" TIMEOUT after ${RUN_TIMEOUT}s"
  if (( rc == 0 && failed == 0 && errors == 0 )); then
    ok_runs=$((ok_runs + 1))
    verdict=ok
    [[ -n "${KEEP:-}" ]] || rm -rf "$dir"
  else
    verdict="FAIL (rc=$rc$note; log kept: $log)"
  fi
  TALLY+=("run $i: $passed passed, $failed failed, $errors errors, $skipped skipped in $((SECONDS - t0))s: $verdict")
  echo "${TALLY[-1]}"
done

echo "=== soak summary: $ok_runs/$N runs clean at ${SHA:0:12} in $((SECONDS - start_all))s"
printf '  %s\n' "${TALLY[@]}"
[[ -n "${KEEP:-}" ]] || { rm -f "$BASE/shared"; rmdir "$BASE" 2>/dev/null; } || true
(( ok_runs == N ))
