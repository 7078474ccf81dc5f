"""Accelerate's by_feature loops on the ports' model and data, for the bitwise comparisons of
tests/test_by_feature.py (one process; needs accelerate, which the test extra does not install).

python tests/by_feature_accelerate.py EXAMPLE  prints the final parameters as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(example: str) -> None:
    # Imported here: pytest's --doctest-modules imports this file, where accelerate may be missing.
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
