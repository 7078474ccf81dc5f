"""Marks for tests kept out of the default suite's time budget (2 cores, ~8 minutes with ``-n 2``).

``EXAMPLE_RUN``: an example script run end to end under torchrun on 2 processes, several launches
each (30-60 s a test here). What each proves is also proved by the suite's own 2-rank tests on
smaller set-ups; these add the examples' full loops. ``scripts/prove_examples.sh`` runs them
(``FACCEL_TEST_EXAMPLES=1``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T", bound=Callable[..., object])

EXAMPLE_RUN = (
    pytest.mark.example_runs,
    pytest.mark.skipif(
        os.environ.get("FACCEL_TEST_EXAMPLES") != "1",
        reason="an example's full run under torchrun: FACCEL_TEST_EXAMPLES=1 (scripts/prove_examples.sh)",
    ),
)

# ``EXPERT_MOVES``: expert parallelism's checkpoint moves (expert=2 -> one process, -> expert=4,
# -> shard=2) and its Hugging Face export read by from_pretrained, on 2 and 4 gloo processes with a
# transformers model (18 s together on a quiet machine here, 3 minutes under load).
# ``scripts/prove_experts.sh`` runs them (``FACCEL_TEST_EXPERTS=1``); the suite's own 2-rank test
# trains against one process.
EXPERT_MOVES = (
    pytest.mark.expert_moves,
    pytest.mark.skipif(
        os.environ.get("FACCEL_TEST_EXPERTS") != "1",
        reason="expert parallelism's checkpoint moves: FACCEL_TEST_EXPERTS=1 (scripts/prove_experts.sh)",
    ),
)


def expert_moves(test: T) -> T:
    """Apply both marks of :data:`EXPERT_MOVES` to ``test``."""
    for mark in EXPERT_MOVES:
        test = mark(test)
    return test


def example_run(test: T) -> T:
    """Apply both marks of :data:`EXAMPLE_RUN` to ``test``."""
    for mark in EXAMPLE_RUN:
        test = mark(test)
    return test
