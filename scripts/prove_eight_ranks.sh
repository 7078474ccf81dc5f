#!/usr/bin/env bash
# The 8-process layouts (three dimensions larger than 1 at once: pipeline x shard x tensor and
# replicate x shard x tensor) against one process, and the pipeline x shard x tensor checkpoint
# restored at pipeline=1 and pipeline=4; kept out of the default suite's budget.
# Set PYTHON to choose the interpreter (default python3). faccel is used from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FACCEL_TEST_EIGHT=1
"$PY" -m pytest -q -p no:cacheprovider -n 0 -m eight_ranks tests/distributed/test_eight_ranks.py "$@"
