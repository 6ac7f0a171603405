#!/usr/bin/env bash
# `make test`: every test in two pytest sessions side by side, mypy beside them at nice 19:
# - in the background, the real-node tests (marker `realnode`: e2e and
#   tests/devcluster/test_realnodes.py);
# - here, every other test.
# (Moving tests/operator into the background half was tried: the real-node half, whose node daemons
# run at nice 19, stretches most under load, and it became the longer one in two CI runs of three.)
# Why side by side: both halves spend most of their time waiting (on kubelets and containers, on
# torchrun start-ups and emulated compute), so on two cores they take about as long together as the
# longer one alone (CI-like runs on the 2-core VM: 32-38 minutes instead of 44-48). The background half writes to
# $LOGS/realnode.log (follow it with `tail -f`), printed here when both are done; so is mypy's
# output. Any failure in either half, or a type error, fails the run.
# Usage: tests/run-all.sh [pytest options for both halves, e.g. -x]
set -u
BIN=${BIN:-.venv/bin}
LOGS=${LOGS:-.venv}
TYPED=${TYPED:-operator/src trainer/src devcluster tests/devcluster e2e bench}

# shellcheck disable=SC2086  # TYPED is a list of paths
nice -n 19 "$BIN/mypy" $TYPED > "$LOGS/mypy.log" 2>&1 &
types=$!
"$BIN/pytest" -q -p no:cacheprovider -m realnode "$@" > "$LOGS/realnode.log" 2>&1 &
real=$!
# A non-interactive shell's background jobs may ignore Ctrl-C: pass it on as SIGTERM too, which the
# real-node pytest turns into a clean teardown of its cluster (devcluster/pytest_plugin.py).
trap 'kill -TERM "$real" "$types" 2>/dev/null; wait "$real"; exit 130' INT TERM
echo "real-node tests: pid $real, output in $LOGS/realnode.log; the other tests here:"

"$BIN/pytest" -q -m "not realnode" "$@"
rest=$?
echo "==== the other tests: exit $rest; waiting for the real-node tests ($LOGS/realnode.log) ===="
wait "$real"
realrc=$?
cat "$LOGS/realnode.log"
echo "==== the real-node tests: exit $realrc ===="
wait "$types"
typed=$?
echo "mypy:"
cat "$LOGS/mypy.log"
if [ "$typed" -ne 0 ]; then echo "mypy found type errors (above)"; fi
[ "$rest" -eq 0 ] && [ "$realrc" -eq 0 ] && [ "$typed" -eq 0 ]
