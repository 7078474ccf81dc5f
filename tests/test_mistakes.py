"""The mistakes a user ported from Accelerate makes first, run as the user writes them.

The user's code runs in a fresh interpreter, without the test suite's runtime type
checker, so what is checked is the error a user really sees. docs/mistakes.md lists
each case with its message and fix.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# case -> the user's code; each must raise a faccel error.
_CASES = {
    "backward(loss)": "faccel.backward(loss)",
    "backward(dist, 1.0)": "faccel.backward(dist, 1.0)",
    "backward(dist, loss.item())": "faccel.backward(dist, loss.item())",
    "non-scalar loss": "faccel.backward(dist, model(x) - 1)",
    "checkpoint(state, path)": "faccel.checkpoint(state, 'ckpt')",
    "prepare(model) without dist": "faccel.prepare(model)",
    "local_sgd(every=2.5)": "with faccel.local_sgd(dist, model, every=2.5): pass",
    "local.step('3')": "with faccel.local_sgd(dist, model, every=2) as local: local.step('3')",
    "profile(schedule={'wait': '1'})": "with faccel.profile(dist, schedule={'wait': '1'}): pass",
}

_SCRIPT = """
import json, sys, torch, faccel
dist = faccel.detect({})
model = torch.nn.Linear(2, 1)
x = torch.ones(3, 2)
loss = model(x).mean()
state = faccel.TrainState.create(model=model, optimizer=None, step=1)
out = {}
for case, code in json.loads(sys.argv[1]).items():
    try:
        exec(code)
        out[case] = ["no error", ""]
    except Exception as error:
        out[case] = [type(error).__name__, str(error), isinstance(error, faccel.errors.FaccelError)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def seen() -> dict[str, list]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(_CASES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("case", "error", "fix"),
    [
        ("backward(loss)", "ArgumentError", "faccel.backward(dist, loss)"),
        ("backward(dist, 1.0)", "ArgumentError", "not loss.item()"),
        ("backward(dist, loss.item())", "ArgumentError", "not loss.item()"),
        ("non-scalar loss", "ArgumentValueError", "loss.mean()"),
        (
            "checkpoint(state, path)",
            "ArgumentError",
            "faccel.checkpoint(dist, ...) with dist = faccel.detect()",
        ),
        ("prepare(model) without dist", "ArgumentError", "faccel.prepare(dist, ...)"),
        ("local_sgd(every=2.5)", "ArgumentError", '"every" (float) is not an instance of int'),
        ("local.step('3')", "ArgumentError", "local.step(n) takes n, the optimizer steps so far"),
        ("profile(schedule={'wait': '1'})", "ArgumentError", "value of key 'wait' is not an instance of int"),
    ],
)
def test_the_first_mistakes_get_a_named_error_that_names_the_fix(
    seen: dict[str, list], case: str, error: str, fix: str
) -> None:
    name, message, is_faccel = seen[case]
    assert (name, is_faccel) == (error, True), message
    assert fix in message


def test_print_writes_on_the_main_process_only(capsys: pytest.CaptureFixture[str]) -> None:
    from faccel._dist._state import DistState
    from faccel._report._logging import print as faccel_print

    faccel_print(DistState.simulated(rank=0, world_size=2), "loss", 0.5, sep="=")
    faccel_print(DistState.simulated(rank=1, world_size=2), "hidden")
    faccel_print(DistState.simulated(rank=1, world_size=2), "shown", main_process_only=False)
    assert capsys.readouterr().out == "loss=0.5\nshown\n"


def test_the_mistakes_page_names_tests_that_exist() -> None:
    text = (ROOT / "docs" / "mistakes.md").read_text()
    named = set(re.findall(r"`(tests/[\w/]+\.py)`", text))
    assert len(named) >= 8
    assert all((ROOT / path).is_file() for path in named), sorted(
        p for p in named if not (ROOT / p).is_file()
    )
