#!/usr/bin/env bash
# Expert parallelism's checkpoint moves (expert=2 -> one process, -> shard=2, -> expert=4, optimizer
# state included, bitwise) and its save_model export read back by transformers' from_pretrained;
# shard=2,expert=2 and pipeline=2,expert=2 on 4 processes against one process; the dispatch bitwise
# against transformers' own Mixtral block (eager, batched_mm). Kept out of the default suite's budget (docs/parallelism.md,
# "Mixture of experts").
# Set PYTHON to choose the interpreter (default python3). faccel is used from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FACCEL_TEST_EXPERTS=1
"$PY" -m pytest -q -p no:cacheprovider -n 0 -m expert_moves tests/test_experts.py tests/distributed/test_experts.py "$@"
