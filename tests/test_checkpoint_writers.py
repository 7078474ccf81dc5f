"""One writer per checkpoint root, attacked with real processes.

Two attacks, each asserting that ``checkpoint()`` never returns a checkpoint
that is not complete (every file the manifest names, of its size and
SHA-256) and that ``restore(root)`` gives a complete checkpoint or a clear
``CheckpointError``:

- two independent jobs (two ``python`` processes, not ranks of one job)
  checkpoint into one root at the same time;
- a second process deletes the root (``shutil.rmtree``) at a random moment
  while a checkpoint is written.

The tests run bounded counts; for long runs, run this file as a script::

    python -m tests.test_checkpoint_writers --concurrent 20 --delete 600
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import faccel
from faccel.errors import CheckpointError, CheckpointWarning
from tests.manifests import matches

CONCURRENT_RUNS = 1
CHECKPOINTS_PER_WRITER = 10
# (the script's runs)
SCRIPT_CHECKPOINTS_PER_WRITER = 20
DELETE_TRIALS = 40
_REPO = Path(__file__).resolve().parent.parent


def _state(step: int) -> faccel.TrainState:
    torch.manual_seed(step)
    model = torch.nn.Linear(512, 512)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 512)).sum().backward()
    optimizer.step()
    return attrs.evolve(faccel.TrainState.create(model=model, optimizer=optimizer), step=step)


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds its manifest and every file it names, of the right size and hash."""
    try:
        manifest = json.loads((folder / "manifest.json").read_bytes())
        for name, record in manifest["files"].items():
            data = (folder / name).read_bytes()
            if not matches(manifest, record, data):
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _restore(root: Path) -> tuple[int | None, str]:
    """The step ``restore(root)`` gives (None for a CheckpointError), and how."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            restored = faccel.restore(faccel.detect({}), _state(0), root)
        except CheckpointError as error:
            assert str(root) in str(error)  # a clear error: it names the root or the folder
            return None, "error"
    assert all(issubclass(w.category, CheckpointWarning) for w in caught), [str(w.message) for w in caught]
    return restored.step, "fallback" if caught else "latest"


# --- attack 1: two jobs, one root -----------------------------------------------------------------


def _writer(root: Path, steps: list[int]) -> None:
    """A job: checkpoint each step into ``root`` and print one JSON line per outcome."""
    dist = faccel.detect({})
    states = {step: _state(step) for step in steps}
    print(json.dumps({"ready": True}), flush=True)
    go = root.with_name(root.name + ".go")
    while not go.exists():
        time.sleep(0.001)
    for step in steps:
        try:
            folder = faccel.checkpoint(dist, states[step], root)
            print(json.dumps({"step": step, "folder": str(folder)}), flush=True)
        except CheckpointError as error:
            print(json.dumps({"step": step, "error": str(error)}), flush=True)


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.test_checkpoint_writers", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=_REPO,
    )


def concurrent_run(root: Path, checkpoints: int) -> dict[str, int]:
    """Two writer processes, even and odd steps, into one root; every returned checkpoint checked."""
    root.mkdir(parents=True)
    writers = [
        _spawn("--writer", str(root), *(str(2 * i + parity) for i in range(checkpoints))) for parity in (0, 1)
    ]
    try:
        for writer in writers:
            assert writer.stdout is not None
            assert json.loads(writer.stdout.readline()) == {"ready": True}
        root.with_name(root.name + ".go").touch()
        outcomes = []
        for writer in writers:
            out, _ = writer.communicate(timeout=120)
            assert writer.returncode == 0
            outcomes += [json.loads(line) for line in out.splitlines()]
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
    committed = [o for o in outcomes if "folder" in o]
    refused = [o for o in outcomes if "error" in o]
    broken = [o["folder"] for o in committed if not _complete(Path(o["folder"]))]
    # the second writer is refused, naming the first one's pid; or, when its first checkpoint comes
    # after the other's later steps are committed, refused for those (a run never meets them later)
    unclear = [
        o
        for o in refused
        if not ("another process is writing a checkpoint" in o["error"] and "pid" in o["error"])
        and "already holds later checkpoints" not in o["error"]
    ]
    step, how = _restore(root)
    wrong = step != max((o["step"] for o in committed), default=None) or how != "latest"
    return {
        "committed": len(committed),
        "refused": len(refused),
        "broken": len(broken),
        "other_errors": len(unclear),
        "restore_not_latest": int(wrong),
    }


def test_two_jobs_checkpointing_into_one_root_never_commit_an_incomplete_checkpoint(tmp_path: Path) -> None:
    totals: dict[str, int] = {}
    for run in range(CONCURRENT_RUNS):
        for key, value in concurrent_run(tmp_path / f"run{run}", CHECKPOINTS_PER_WRITER).items():
            totals[key] = totals.get(key, 0) + value
    # never success for an incomplete checkpoint; every refusal names the other writer; restore: the latest
    assert totals["broken"] == totals["other_errors"] == totals["restore_not_latest"] == 0, totals
    # Some went through (how many depends on how often the writers overlapped: the loser of each
    # overlap is refused at once, and a loaded machine makes overlaps common).
    assert totals["committed"] > 0
    assert totals["refused"] > 0, "the writers never overlapped: the attack did not happen"


# --- attack 2: the root deleted during a write ----------------------------------------------------


def _deleter() -> None:
    """For each line "DELAY ROOT" on stdin: sleep DELAY, delete ROOT, print when it started and ended."""
    for line in sys.stdin:
        delay, root = line.split(" ", 1)
        time.sleep(float(delay))
        start = time.monotonic()
        shutil.rmtree(root.strip(), ignore_errors=True)
        print(f"{start} {time.monotonic()}", flush=True)


def delete_trials(base: Path, trials: int, seed: int) -> dict[str, int]:
    """Checkpoint step 1 over a complete step 0 while another process deletes the root."""
    rng = random.Random(seed)
    dist = faccel.detect({})
    previous, state = _state(0), _state(1)
    timing = base / "timing"
    faccel.checkpoint(dist, previous, timing)
    began = time.monotonic()
    faccel.checkpoint(dist, state, timing)
    duration = time.monotonic() - began
    counts = dict.fromkeys(
        ["refused", "committed", "deleted_after", "deleted_after_commit", "overlapping", "broken"], 0
    )
    counts |= dict.fromkeys(["restored_latest", "restored_fallback", "restore_error"], 0)
    deleter = _spawn("--deleter")
    assert deleter.stdin is not None and deleter.stdout is not None
    try:
        for trial in range(trials):
            root = base / f"t{trial}"
            faccel.checkpoint(dist, previous, root)
            deleter.stdin.write(f"{rng.uniform(0, 1.2 * duration)} {root}\n")
            deleter.stdin.flush()
            try:
                folder: Path | None = faccel.checkpoint(dist, state, root)
            except CheckpointError:
                folder = None
            returned = time.monotonic()
            start, end = map(float, deleter.stdout.readline().split())
            if folder is None:
                counts["refused"] += 1
            elif end < returned:  # deleted while checkpoint() ran: what it returned must be whole
                counts["committed"] += 1
                # Absent: the deletion ran after the commit and its check (the rename into a deleted
                # root fails, and so does the check after it), in the moments before the return.
                # Present: written after the deletion ended, so it must be whole.
                counts["broken"] += folder.exists() and not _complete(folder)
                counts["deleted_after_commit"] += not folder.exists()
            else:  # deleted (or being deleted) after checkpoint() returned: nothing to check
                counts["deleted_after" if start > returned else "overlapping"] += 1
            step, how = _restore(root)
            counts[f"restore{'d_' + how if step is not None else '_error'}"] += 1
            shutil.rmtree(root, ignore_errors=True)
    finally:
        deleter.stdin.close()
        deleter.wait(timeout=30)
        deleter.stdout.close()
    return counts


def test_deleting_the_root_during_a_write_never_commits_an_incomplete_checkpoint(tmp_path: Path) -> None:
    counts = delete_trials(tmp_path, DELETE_TRIALS, seed=12)
    assert counts["broken"] == 0, counts
    assert counts["refused"] > 0, f"no deletion hit a write: {counts}"


# --- what the fix adds, one mechanism at a time ---------------------------------------------------


def test_a_second_writer_is_refused_at_once_naming_the_first(tmp_path: Path) -> None:
    import fcntl

    (tmp_path / ".lock").write_text("host elsewhere, pid 4242\n")
    with open(tmp_path / ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(CheckpointError, match=r"another process is writing.*pid 4242"):
            faccel.checkpoint(faccel.detect({}), _state(3), tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".lock"]  # nothing written, nothing removed
    # Released (as when its holder dies): the next writer goes ahead and tidies the lock file away.
    assert faccel.checkpoint(faccel.detect({}), _state(3), tmp_path).name == "step-000000000003"
    assert sorted(os.listdir(tmp_path)) == ["step-000000000003"]


def test_restore_of_a_root_falls_back_past_a_broken_latest_with_a_warning(tmp_path: Path) -> None:
    dist = faccel.detect({})
    for step in (1, 2, 3):
        faccel.checkpoint(dist, _state(step), tmp_path)
    (tmp_path / "step-000000000003" / "model.safetensors").unlink()
    with open(tmp_path / "step-000000000002" / "optimizer.safetensors", "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        handle.write(b"\x00")
    with pytest.warns(
        CheckpointWarning, match=r"restored step-000000000001.*step-000000000003.*step-000000000002"
    ) as caught:
        assert faccel.restore(dist, _state(0), tmp_path).step == 1
    assert caught[0].filename == __file__  # the warning points at the caller's restore
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the file is missing"):
        faccel.restore(dist, _state(0), tmp_path / "step-000000000003")  # a folder named: no fallback
    (tmp_path / "step-000000000001" / "state.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: the file is missing\. And every checkpoint before it"
    ):
        faccel.restore(dist, _state(0), tmp_path)


def _damage_manifest(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flipped-byte":
        path.write_bytes(data[:10] + bytes([data[10] ^ 0x5A]) + data[11:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "deleted":
        path.unlink()
    else:  # the format field edited
        path.write_bytes(data.replace(b'"format"', b'"formaX"', 1))


@pytest.mark.parametrize("sharded", [False, True], ids=["v1", "v2-sharded"])
@pytest.mark.parametrize("how", ["flipped-byte", "truncated", "deleted", "format-edited"])
def test_a_damaged_latest_manifest_is_passed_over_with_a_warning(
    tmp_path: Path, how: str, sharded: bool
) -> None:
    """The manifest is a file of the checkpoint like any other."""
    dist = faccel.detect({})
    for step in (1, 2):
        faccel.checkpoint(dist, _state(step), tmp_path, sharded=sharded)
    _damage_manifest(tmp_path / "step-000000000002" / "manifest.json", how)
    with pytest.warns(
        CheckpointWarning, match=r"restored step-000000000001.*step-000000000002.*manifest\.json"
    ):
        assert faccel.restore(dist, _state(0), tmp_path).step == 1
    (tmp_path / "step-000000000001" / "manifest.json").unlink()  # nothing whole left: an error, loud
    with pytest.raises(CheckpointError, match=r"no checkpoint there"):
        faccel.restore(dist, _state(0), tmp_path)


def test_a_folder_emptied_before_the_commit_is_not_committed(tmp_path: Path, monkeypatch) -> None:
    from faccel._checkpoint import _jobs

    real = _jobs.check_written
    calls = []

    def emptied(directory: Any, records: Any, *, what: str, **more: Any) -> None:  # a local Spot
        if not calls:
            (Path(directory.key) / "model.safetensors").unlink()
        calls.append(directory.name)
        real(directory, records, what=what, **more)

    monkeypatch.setattr(_jobs, "check_written", emptied)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is gone"):
        faccel.checkpoint(faccel.detect({}), _state(5), tmp_path)
    assert calls == [".tmp-step-000000000005"] and not (tmp_path / "step-000000000005").exists()


def main(argv: list[str] | None = None) -> None:
    """Run the attacks for as many trials as asked, or be one of their processes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrent", type=int, default=20, help="runs of two writers (default 20)")
    parser.add_argument("--delete", type=int, default=60, help="root deletions during a write (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--writer", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--deleter", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.writer:
        _writer(Path(args.writer[0]), [int(step) for step in args.writer[1:]])
        return
    if args.deleter:
        _deleter()
        return
    with tempfile.TemporaryDirectory() as base:
        began = time.monotonic()
        totals: dict[str, int] = {}
        for run in range(args.concurrent):
            for key, value in concurrent_run(Path(base) / f"run{run}", SCRIPT_CHECKPOINTS_PER_WRITER).items():
                totals[key] = totals.get(key, 0) + value
        print(f"{args.concurrent} runs of two writers: {totals} ({time.monotonic() - began:.0f} s)")
        began = time.monotonic()
        counts = delete_trials(Path(base) / "delete", args.delete, args.seed)
        print(f"{args.delete} root deletions during a write: {counts} ({time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
