"""Shared test settings.

faccel is imported lazily (inside tests and fixtures, never here at module
level) so typeguard's import hook (``--typeguard-packages=faccel``) instruments
it before its first import.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# One BLAS thread per process: two xdist workers share two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def keep_global_generators() -> Any:
    """Python's, NumPy's and torch's global generators back as they were after the test."""
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
