"""get_logger(): rank prefix, main process by default, per-call override, the caller's line."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def stream(request: pytest.FixtureRequest) -> Iterator[tuple[str, io.StringIO]]:
    """A logger name of this test's own, with a handler that writes to a string."""
    name = f"faccel_test.{request.node.name}"
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(rank)s/%(world_size)s %(filename)s| %(message)s"))
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield name, out
    logger.removeHandler(handler)


def test_the_main_process_logs_with_its_rank(stream: tuple[str, io.StringIO]) -> None:
    import faccel

    name, out = stream
    log = faccel.get_logger(faccel.DistState.simulated(rank=0, world_size=4), name)
    log.info("epoch %d done", 3)
    log.debug("details")
    assert out.getvalue().splitlines() == [
        "INFO 0/4 test_logging.py| [rank 0/4] epoch 3 done",
        "DEBUG 0/4 test_logging.py| [rank 0/4] details",
    ]


def test_other_ranks_are_silent_unless_asked(stream: tuple[str, io.StringIO]) -> None:
    import faccel

    name, out = stream
    log = faccel.get_logger(faccel.DistState.simulated(rank=1, world_size=2), name)
    log.info("hidden")
    log.warning("hidden too")
    log.log(logging.ERROR, "hidden as well")
    assert out.getvalue() == ""
    log.warning("from every rank", main_process_only=False)
    assert out.getvalue() == "WARNING 1/2 test_logging.py| [rank 1/2] from every rank\n"


def test_the_default_can_be_every_rank_and_overridden_per_call(stream: tuple[str, io.StringIO]) -> None:
    import faccel

    name, out = stream
    log = faccel.get_logger(faccel.DistState.simulated(rank=3, world_size=4), name, main_process_only=False)
    log.info("shown")
    log.info("main only", main_process_only=True)
    assert out.getvalue() == "INFO 3/4 test_logging.py| [rank 3/4] shown\n"


def test_exceptions_extra_and_levels_behave_as_in_logging(stream: tuple[str, io.StringIO]) -> None:
    import faccel

    name, out = stream
    log = faccel.get_logger(faccel.detect({}), name)
    logging.getLogger(name).setLevel(logging.WARNING)
    log.info("below the level")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    text = out.getvalue()
    assert "below the level" not in text
    assert text.startswith("ERROR 0/1 test_logging.py| [rank 0/1] failed\nTraceback")
    assert "ValueError: boom" in text


def test_the_record_names_the_callers_line(caplog: pytest.LogCaptureFixture) -> None:
    import faccel

    log = faccel.get_logger(faccel.detect({}), "faccel_test.caller")
    with caplog.at_level(logging.INFO, logger="faccel_test.caller"):
        log.info("here", extra={"user": "kept"})
    (record,) = caplog.records
    assert record.filename == "test_logging.py"
    assert record.funcName == "test_the_record_names_the_callers_line"
    assert (record.rank, record.world_size, record.user) == (0, 1, "kept")  # type: ignore[attr-defined]
    assert record.getMessage() == "[rank 0/1] here"


def test_print_writes_each_line_in_one_write_so_ranks_lines_never_merge() -> None:
    # Under torchrun the workers run unbuffered (python -u) into one pipe, and the builtin print
    # writes the text and its newline apart: two ranks' lines merged ("step 7step 7\n\n").
    import faccel

    class Recording:
        def __init__(self) -> None:
            self.writes: list[str] = []
            self.flushed = 0

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            self.flushed += 1

    out = Recording()
    dist = faccel.DistState.simulated(rank=1, world_size=2)
    faccel.print(dist, "rank", 1, "step", 7, main_process_only=False, file=out, flush=True)
    faccel.print(dist, "a", "b", sep="-", end="!\n", main_process_only=False, file=out)
    faccel.print(dist, "not on rank 1", file=out)
    assert out.writes == ["rank 1 step 7\n", "a-b!\n"] and out.flushed == 1
    with pytest.raises(TypeError):
        faccel.print(dist, "x", main_process_only=False, colour="red")


@pytest.mark.parametrize(
    ("env", "where"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "1/2"),  # torchrun's
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, "3/4"),  # read before through RANK alone: 0/1
        ({"RANK": "x", "WORLD_SIZE": "2"}, "0/1"),  # malformed: detect() reports it, not a log line
    ],
)
def test_a_logger_without_a_dist_state_reads_the_launcher_table(
    stream: tuple[str, io.StringIO], monkeypatch: pytest.MonkeyPatch, env: dict[str, str], where: str
) -> None:
    # RANK / WORLD_SIZE were read here by name, beside faccel._dist._launch's table.
    import faccel

    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    name, out = stream
    faccel.get_logger(name, main_process_only=False).info("here")
    assert out.getvalue().split("|")[0].split()[1] == where
