"""Each closed set's ``Literal`` (faccel._choices and beside its table) holds the words its table does."""

from __future__ import annotations

from typing import get_args

import pytest


def test_each_literal_is_its_tables_keys() -> None:
    from faccel._choices import Backend, CommHookName, Engine, Launcher, ReduceOpName
    from faccel._dist._collectives import _OPS
    from faccel._dist._launch import LAUNCHERS
    from faccel._dist._state import _BACKEND_DEVICES
    from faccel._func._functional import _ENGINES
    from faccel._loop._strategies._ddp._comm_hooks import _HOOKS
    from faccel._loop._strategies._pipeline._stages import SCHEDULES, ScheduleKind

    assert set(get_args(ScheduleKind)) == set(SCHEDULES)
    assert set(get_args(CommHookName)) == set(_HOOKS)
    assert set(get_args(ReduceOpName)) == set(_OPS)
    assert get_args(Engine) == _ENGINES
    assert set(_BACKEND_DEVICES) <= set(get_args(Backend))
    assert set(get_args(Launcher)) == {*LAUNCHERS, "none", "simulated"}


def test_a_word_outside_a_closed_set_is_a_bad_value_named_at_the_call() -> None:
    import torch

    import faccel

    with pytest.raises(faccel.errors.LaunchError, match=r"backend must be one of \('gloo'"):
        faccel.detect({}, backend="tcp")  # type: ignore[arg-type]
    with pytest.raises(faccel.errors.ArgumentValueError, match="comm_hook must be one of"):
        faccel.prepare(faccel.detect({}), torch.nn.Linear(2, 2), comm_hook="fp8")  # type: ignore[arg-type]
