"""``strategy="deepspeed"`` in one plain process (no launcher variables): no mpi4py needed.

Before: ``prepare`` raised ``ModuleNotFoundError: No module named 'mpi4py'`` from inside DeepSpeed,
which, finding no ``RANK``/``MASTER_ADDR``, looked for MPI. Run in a fresh interpreter with those
variables removed (a process group made here would outlive the test).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import json, sys, torch, faccel
dist = faccel.detect(deepspeed={"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"})
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
loader = torch.utils.data.DataLoader(data, batch_size=4)
model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
for x, y in loader.at(epoch=0):
    loss = torch.nn.functional.mse_loss(model(x), y)
    faccel.backward(dist, loss)
    optimizer.step()
    optimizer.zero_grad()
faccel.shutdown(dist)
print(json.dumps({"clip": model.gradient_clipping(), "group": torch.distributed.is_initialized(),
                  "accelerator": __import__("deepspeed").accelerator.get_accelerator().device_name(),
                  "mpi4py": "mpi4py" in sys.modules}))
"""

_LAUNCHER = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DS_ACCELERATOR",
}


def _plain_process(script: str, *args: str) -> dict:
    """``script`` in a fresh interpreter without launcher variables; its last stdout line, as JSON."""
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER and not k.startswith(("OMPI_", "SLURM_"))
    }
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-c", script, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_one_plain_process_trains_under_deepspeed_without_mpi4py() -> None:
    result = _plain_process(_SCRIPT)
    assert result == {"clip": 1.0, "group": False, "accelerator": "cpu", "mpi4py": False}


_TORCH_OPTIMIZER_CONFIG_SCHEDULE = """
import json, torch, faccel
config = {"zero_optimization": {"stage": 2},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "warmup_type": "linear"}}}
dist = faccel.detect(deepspeed=config)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
loader = torch.utils.data.DataLoader(data, batch_size=4)
model, optimizer, loader, scheduler = faccel.prepare(
    dist, model, optimizer, loader, faccel.ConfigScheduler(warmup_num_steps=4))
lrs = []
for x, y in loader.at(epoch=0):
    faccel.backward(dist, torch.nn.functional.mse_loss(model(x), y))
    faccel.optimizer_step(dist, optimizer, scheduler=scheduler)
    optimizer.zero_grad()
    lrs.append(scheduler.get_last_lr()[0])
faccel.shutdown(dist)
print(json.dumps({"lrs": lrs, "scheduler": repr(scheduler), "optimizer": type(optimizer.optimizer).__name__}))
"""


def test_a_torch_optimizer_with_the_configs_scheduler_section_in_one_plain_process() -> None:
    """DeepSpeed's schedule from the config over the torch optimizer prepared with it: stepped by the
    engine once per optimizer step (WarmupLR, linear: iteration i sets 0.1 * i / 4, the engine's first
    step being iteration 0)."""
    result = _plain_process(_TORCH_OPTIMIZER_CONFIG_SCHEDULE)
    assert result["scheduler"] == "DeepSpeedScheduler(WarmupLR)" and result["optimizer"] == "SGD"
    assert result["lrs"] == pytest.approx([0.0, 0.025, 0.05, 0.075])  # warmup_max_lr: the optimizer's 0.1


_FORMER_NAMES = """
import json, sys, blake3, torch, faccel
from pathlib import Path
root = Path(sys.argv[1])
config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2,
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "warmup_type": "linear"}}}
dist = faccel.detect(deepspeed=config)

def made():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return faccel.prepare(dist, model, optimizer, faccel.ConfigScheduler(warmup_num_steps=4))

model, optimizer, scheduler = made()
for _ in range(2):
    faccel.backward(dist, model(torch.ones(2, 4)).square().mean())
    faccel.optimizer_step(dist, optimizer, scheduler=scheduler)
    optimizer.zero_grad()
state = faccel.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, step=2)
path = faccel.checkpoint(dist, state, root)
recorded = json.loads((path / "state.json").read_text())
for section, old in (("optimizer", "DeepSpeedOptimizer"), ("scheduler", "DeepSpeedScheduler")):
    recorded[section]["class"] = "faccel._loop._deepspeed." + old
data = json.dumps(recorded).encode()
(path / "state.json").write_bytes(data)
manifest = json.loads((path / "manifest.json").read_text())
manifest["files"]["state.json"] = {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
(path / "manifest.json").write_text(json.dumps(manifest))
model2, optimizer2, scheduler2 = made()
back = faccel.restore(dist, faccel.TrainState(model=model2, optimizer=optimizer2, scheduler=scheduler2), root)
same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
faccel.shutdown(dist)
print(json.dumps({"step": back.step, "same": same, "lr": scheduler2.get_last_lr()[0]}))
"""


def test_a_checkpoint_naming_the_deepspeed_classes_by_their_former_module_restores(tmp_path: Path) -> None:
    """The DeepSpeed optimizer and scheduler moved module; ``state.json`` written before the move
    names them ``faccel._loop._deepspeed.*``, and restore accepts those names (it refused them as
    another class before)."""
    result = _plain_process(_FORMER_NAMES, str(tmp_path / "run"))
    assert result == {"step": 2, "same": True, "lr": pytest.approx(0.025)}  # two warmup steps of four
