#!/usr/bin/env bash
# The examples' full runs under torchrun on 2 processes (kill and resume, load by rows, pipeline
# stages), kept out of the default suite's budget (tests/budget.py). Set PYTHON to choose the
# interpreter (default python3). faccel is used from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FACCEL_TEST_EXAMPLES=1
"$PY" -m pytest -q -p no:cacheprovider -n 0 -m example_runs tests "$@"
