#!/usr/bin/env bash
# `make test`'s pytest and mypy, in two halves side by side with mypy beside them at nice 19:
# - in the background, the real-node tests (marker `realnode`: tests/e2e and
#   tests/devcluster/test_realnodes.py), then the tiers named in $BESIDE (tests/operator), which
#   evens out the halves;
# - here, every other test.
# Why side by side: both halves spend most of their time waiting (on kubelets and containers, on
# torchrun start-ups and emulated compute), so on two cores they take about as long together as the
# longer one alone (CI on the 2-core VM: 32 minutes instead of 43). The background half writes to
# $LOGS/realnode.log (follow it with `tail -f`), printed here when both are done; so is mypy's
# output. Any failure in either half, or a type error, fails the run.
# Usage: tests/run-all.sh [pytest options for both halves, e.g. -x]
set -u
BIN=${BIN:-.venv/bin}
LOGS=${LOGS:-.venv}
TYPED=${TYPED:-operator/src trainer/src devcluster tests/devcluster tests/e2e bench}
BESIDE=${BESIDE:-tests/operator}

# shellcheck disable=SC2086  # TYPED is a list of paths
nice -n 19 "$BIN/mypy" $TYPED > "$LOGS/mypy.log" 2>&1 &
types=$!
# shellcheck disable=SC2086  # BESIDE is a list of paths
(
  trap 'exit 130' TERM # after the running pytest has torn down (the parent signals both)
  "$BIN/pytest" -q -p no:cacheprovider -m realnode "$@"
  first=$?
  [ "$first" -eq 2 ] && exit 2 # interrupted (pytest's exit code 2): not on to the next tiers
  "$BIN/pytest" -q -p no:cacheprovider -m "not realnode" $BESIDE "$@"
  second=$?
  [ "$first" -eq 0 ] && [ "$second" -eq 0 ]
) > "$LOGS/realnode.log" 2>&1 &
real=$!
# A non-interactive shell's background jobs ignore Ctrl-C: pass it on as SIGTERM, which the real-node
# pytest turns into a clean teardown of its cluster (devcluster/pytest_plugin.py).
trap 'pkill -TERM -P "$real"; kill -TERM "$real" "$types" 2>/dev/null; wait "$real"; exit 130' INT TERM
echo "real-node tests, then $BESIDE: pid $real, output in $LOGS/realnode.log; the other tests here:"

ignored=()
for tier in $BESIDE; do ignored+=("--ignore=$tier"); done
"$BIN/pytest" -q -m "not realnode" "${ignored[@]}" "$@"
rest=$?
echo "==== the other tests: exit $rest; waiting for the real-node tests and $BESIDE ($LOGS/realnode.log) ===="
wait "$real"
realrc=$?
cat "$LOGS/realnode.log"
echo "==== the real-node tests and $BESIDE: exit $realrc ===="
wait "$types"
typed=$?
echo "mypy:"
cat "$LOGS/mypy.log"
if [ "$typed" -ne 0 ]; then echo "mypy found type errors (above)"; fi
[ "$rest" -eq 0 ] && [ "$realrc" -eq 0 ] && [ "$typed" -eq 0 ]
