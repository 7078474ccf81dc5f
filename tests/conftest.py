"""Shared test settings.

faccel is imported lazily (inside tests and fixtures, never here at module
level) so typeguard's import hook (``--typeguard-packages=faccel``) instruments
it before its first import.
"""

from __future__ import annotations

import os

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
