"""The long proof of every loader form's law: thousands of hypothesis examples, up to 256 ranks.

    PYTHONPATH=. python scripts/prove_data_forms.py [examples]   # default 20000

The suite runs the same property (tests/test_data_forms.py) with 60 examples; this runs it with
many more: for the plain order, a custom sampler's output (with repeats) and a batch sampler's
batches, every rank's share is dealt from one order, covers it once plus the reported padding,
and a view resumed at any batch is a suffix of the straight one.
"""

from __future__ import annotations

import sys
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import test_data_forms
from tests.strategies import sampler_forms


def main(examples: int) -> None:
    proof = settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))(
        given(sampler_forms(max_world=256), st.integers(0, 3), st.data())(test_data_forms.form_law)
    )
    start = time.perf_counter()
    proof()
    print(f"{examples} examples of each form's law passed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000)
