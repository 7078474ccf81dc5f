"""Accelerate's by_feature loops on the ports' model and data, for the bitwise comparisons of
tests/test_by_feature.py (one process; needs accelerate, which the test extra does not install).

python tests/by_feature_accelerate.py EXAMPLE  prints the final parameters as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

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


def main(example: str) -> None:
    # Imported here: pytest's --doctest-modules imports this file, where accelerate may be missing.
    if example == "schedule_free":
        schedule_free()
        return
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from tests.test_by_feature import _data, _model

    steps = {"gradient_accumulation": 2, "local_sgd": 1}[example]
    accelerator = Accelerator(
        gradient_accumulation_steps=steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        cpu=True,
    )
    set_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    train = DataLoader(_data(24), batch_size=4, shuffle=True)
    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    for _ in range(2):
        for x, y in train:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    print(json.dumps([p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]))


if __name__ == "__main__":
    main(sys.argv[1])
