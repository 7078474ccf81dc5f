"""Run ``python -m faccel ARGS`` many times without paying ``import torch`` each time.

A helper interpreter imports faccel (and so torch) once, then forks one child per
command; the child runs ``runpy.run_module("faccel", run_name="__main__")`` with
``sys.argv`` set, which is what ``python -m faccel`` runs, in a fresh process with
its own stdout, stderr, exit status and peak memory (``os.wait4``). An exception
that escapes is printed as the interpreter prints it (a traceback) with status 1,
so a test sees exactly what a user would. A command still running after its
timeout is killed and reported as hung (the timeout only bounds a failure).

Used by ``tests/test_cli_hostile.py``; a few of its commands also run as real
``python -m faccel`` subprocesses there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_SERVER = r"""
import json, os, runpy, signal, sys, time, traceback
# What every command imports first, paid once here (faccel.__main__ itself runs fresh in each child).
import faccel, faccel._report._metrics_file, faccel._report._memory_plan, faccel._hf._save_model
try:  # what plan and plot import, when installed
    from transformers import AutoConfig, AutoModelForCausalLM
    import matplotlib.figure, matplotlib.backends.backend_agg
except ImportError:
    pass

def run(request):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(request["cwd"])
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(err, 2)
            sys.argv = ["faccel", *request["argv"]]
            try:
                runpy.run_module("faccel", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as stop:
                if stop.code is None:
                    code = 0
                elif isinstance(stop.code, int):
                    code = stop.code
                else:
                    print(stop.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return {"status": os.waitstatus_to_exitcode(status), "maxrss_kb": usage.ru_maxrss, "hung": False}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            return {"status": None, "maxrss_kb": usage.ru_maxrss, "hung": True}
        time.sleep(0.02)

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    print(json.dumps(run(json.loads(line))), flush=True)
"""


class WarmFaccel:
    """One helper interpreter with faccel imported; :meth:`run` forks a ``python -m faccel`` from it."""

    def __init__(self, root: Path, scratch: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
        self._scratch = scratch
        self._count = 0
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        assert self._server.stdout is not None
        json.loads(self._server.stdout.readline())

    def run(self, argv: list[str], *, cwd: Path, timeout: float = 120) -> dict[str, Any]:
        """``python -m faccel *argv`` in ``cwd``: its status, stdout, stderr, peak RSS and whether it hung."""
        self._count += 1
        out, err = self._scratch / f"{self._count}.out", self._scratch / f"{self._count}.err"
        request = {"argv": argv, "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "timeout": timeout}
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        answer: dict[str, Any] = json.loads(self._server.stdout.readline())
        answer["stdout"] = out.read_text(errors="replace")
        answer["stderr"] = err.read_text(errors="replace")
        return answer

    def close(self) -> None:
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.close()
        self._server.wait(timeout=60)
        self._server.stdout.close()
