"""Accelerate's by_feature loops on the ports' model and data, for the bitwise comparisons of
tests/test_by_feature.py (one process; needs accelerate, which the test extra does not install).

python tests/by_feature_accelerate.py EXAMPLE  prints the final parameters as JSON;
python tests/by_feature_accelerate.py all      every twin's, as one JSON object keyed by example;
python tests/by_feature_accelerate.py schedule_free  examples/by_feature/schedule_free.py's twin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def schedule_free() -> None:
    """examples/by_feature/schedule_free.py's loop under Accelerate, as upstream writes it."""
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "by_feature"))
    from schedule_free import CONFIG, datasets, schedule_free_adamw, tiny_bert

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(CONFIG["seed"])
    train_set, eval_set = datasets()
    train_dataloader = DataLoader(train_set, batch_size=CONFIG["batch_size"], shuffle=True, drop_last=True)
    eval_dataloader = DataLoader(eval_set, batch_size=8)
    model = tiny_bert().to(accelerator.device)
    optimizer = schedule_free_adamw(model, CONFIG)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    for _ in range(CONFIG["num_epochs"]):
        model.train()
        optimizer.train()
        for input_ids, labels in train_dataloader:
            accelerator.backward(model(input_ids=input_ids, labels=labels).loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        optimizer.eval()
        for input_ids, labels in eval_dataloader:
            with torch.no_grad():
                predictions = model(input_ids=input_ids).logits.argmax(dim=-1)
            accelerator.gather_for_metrics((predictions, labels))
    print(json.dumps([p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]))


def _weights(accelerator: Any, model: Any) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]


def _accelerator(**kwargs: Any) -> Any:
    from accelerate import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(use_seedable_sampler=True)
    return Accelerator(dataloader_config=config, cpu=True, **kwargs)


def _plain(
    *,
    batch_size: int = 4,
    n: int = 24,
    epochs: int = 1,
    steps: int = 1,
    stop_at: int | None = None,
    evaluate: bool = False,
    **accelerator_kwargs: Any,
) -> list[list[float]]:
    """The ports' shared loop (tests/test_by_feature.py ``_setup`` / ``_epoch``) under Accelerate."""
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from tests.test_by_feature import _data, _model

    accelerator = _accelerator(gradient_accumulation_steps=steps, **accelerator_kwargs)
    set_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    train = DataLoader(_data(n), batch_size=batch_size, shuffle=True)
    evaluation = DataLoader(_data(10, seed=1), batch_size=4)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    for _ in range(epochs):
        for step, (x, y) in enumerate(train):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if stop_at is not None and step == stop_at:
                return _weights(accelerator, model)
        if evaluate:
            with torch.no_grad():
                for x, y in evaluation:
                    accelerator.gather_for_metrics((model(x).argmax(1), y))
    return _weights(accelerator, model)


def cross_validation() -> list[list[float]]:
    """cross_validation.py's folds: a fresh model per fold, seeded by the fold."""
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, Subset

    from tests.test_by_feature import _data, _model

    data = _data(24)
    out: list[list[float]] = []
    for fold in range(3):
        accelerator = _accelerator()
        set_seed(fold)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        train_ids = [i for i in range(24) if i % 3 != fold]
        train = DataLoader(Subset(data, train_ids), batch_size=4, shuffle=True)
        model, optimizer, train = accelerator.prepare(model, optimizer, train)
        for x, y in train:
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        out += _weights(accelerator, model)
    return out


def autoregressive() -> list[list[float]]:
    """gradient_accumulation_for_autoregressive_models.py: the group's tokens counted first, each
    batch's loss summed over its tokens and divided by the count, times what backward divides by."""
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_by_feature import _tokens

    steps = 2
    accelerator = _accelerator(gradient_accumulation_steps=steps)
    set_seed(0)
    tokens = _tokens()
    model = torch.nn.Embedding(5, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(TensorDataset(tokens), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    for _ in range(len(loader) // steps):
        group = [next(batches) for _ in range(steps)]
        num_items = sum(int((batch != -100).sum()) for (batch,) in group)
        # As upstream: no accumulate(); the whole group pre-loaded (its tokens counted), one step after it.
        for (batch,) in group:
            logits = model(batch.clamp(min=0))
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, 5), batch.reshape(-1), ignore_index=-100, reduction="sum"
            )
            loss = loss / num_items
            accelerator.backward(loss * steps * accelerator.num_processes)  # backward divides by steps
        optimizer.step()
        optimizer.zero_grad()
    return _weights(accelerator, model)


def complete_nlp_example() -> list[list[float]]:
    """complete_nlp_example.py on the ports' tiny BERT: a linear schedule over the epoch."""
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from tests.test_by_feature import _nlp_data, _tiny_bert

    accelerator = _accelerator()
    set_seed(0)
    model = next(_tiny_bert())
    train_set, eval_set = _nlp_data()
    train = DataLoader(train_set, batch_size=4, shuffle=True)
    evaluation = DataLoader(eval_set, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=len(train))
    for x, y in train:
        accelerator.backward(model(input_ids=x, labels=y).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return _weights(accelerator, model)


def profiler() -> list[list[float]]:
    """profiler.py: the loop inside ``accelerator.profile()``."""
    import tempfile

    from accelerate.utils import ProfileKwargs

    with tempfile.TemporaryDirectory() as folder:
        return _plain(kwargs_handlers=[ProfileKwargs(output_trace_dir=folder, record_shapes=True)])


def ddp_comm_hook() -> list[list[float]]:
    """ddp_comm_hook.py with PowerSGD (one process: no DDP, so no hook)."""
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    hook = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD)
    return _plain(kwargs_handlers=[hook])


# Each port of tests/test_by_feature.py that trains, under Accelerate (1 process).
TWINS: dict[str, Any] = {
    "gradient_accumulation": lambda: _plain(epochs=2, steps=2),
    "local_sgd": lambda: _plain(epochs=2),
    "checkpointing": lambda: _plain(epochs=2),
    "memory": lambda: _plain(batch_size=9),
    "automatic_gradient_accumulation": lambda: _plain(batch_size=8, n=32, steps=2),
    "multi_process_metrics": lambda: _plain(evaluate=True),
    "tracking": lambda: _plain(epochs=2, evaluate=True),
    "cross_validation": cross_validation,
    "early_stopping": lambda: _plain(stop_at=2),
    "gradient_accumulation_for_autoregressive_models": autoregressive,
    "complete_nlp_example": complete_nlp_example,
    "profiler": profiler,
    "ddp_comm_hook": ddp_comm_hook,
}


def warmup_schedule() -> None:
    """A script's ``get_linear_schedule_with_warmup(num_warmup_steps=8, num_training_steps=24)`` under
    Accelerate on however many processes it is launched (torchrun): rank 0 prints the lr after each of
    12 optimizer steps. The porting guide's conversion reproduces it (tests/test_porting.py)."""
    import torch
    import transformers

    accelerator = _accelerator()
    w = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([w], lr=1.0)
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=8, num_training_steps=24
    )
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    lrs = []
    for _ in range(12):
        w.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    if accelerator.is_main_process:
        print(json.dumps({"processes": accelerator.num_processes, "lrs": lrs}))


def main(example: str) -> None:
    # Imported here: pytest's --doctest-modules imports this file, where accelerate may be missing.
    if example == "schedule_free":
        schedule_free()
        return
    if example == "warmup_schedule":
        warmup_schedule()
        return
    if example == "all":
        print(json.dumps({name: twin() for name, twin in TWINS.items()}))
        return
    print(json.dumps(TWINS[example]()))


if __name__ == "__main__":
    main(sys.argv[1])
