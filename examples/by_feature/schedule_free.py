"""Accelerate's ``examples/by_feature/schedule_free.py`` ported to faccel.

Facebook's schedule-free AdamW (``pip install schedulefree``) needs no LR scheduler; it keeps two
sets of weights, so the loop switches the optimizer with the model: ``optimizer.train()`` before
training, ``optimizer.eval()`` before evaluating (and before saving). faccel changes nothing about
that: the optimizer is prepared as is. As upstream: a BERT sequence classifier, ``warmup_steps``
of the optimizer, accuracy over the evaluation set each epoch from ``gather_for_metrics``; here a
tiny BERT built from a config (no download, dropout 0) on synthetic tokens.

python examples/by_feature/schedule_free.py [--json]
torchrun --standalone --nproc-per-node 2 examples/by_feature/schedule_free.py

``--json`` prints the final weights (the evaluation weights) as one JSON line, which
tests/test_by_feature.py compares with Accelerate's run of the same loop
(tests/by_feature_accelerate.py schedule_free), bitwise.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import faccel

CONFIG = {"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 4, "warmup_steps": 3}


def tiny_bert() -> torch.nn.Module:
    """A one-layer BERT classifier from a config: no download; dropout 0 (the runs compare bitwise)."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """Synthetic sentence pairs as token ids: 32 to train on, 10 to evaluate (a short last batch)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (42, 8), generator=generator)
    labels = (ids[:, 0] > 25).long()
    return TensorDataset(ids[:32], labels[:32]), TensorDataset(ids[32:], labels[32:])


def schedule_free_adamw(model: torch.nn.Module, config: dict[str, Any]) -> torch.optim.Optimizer:
    import schedulefree

    return schedulefree.AdamWScheduleFree(
        model.parameters(), lr=config["lr"], warmup_steps=config["warmup_steps"]
    )


def training_function(config: dict[str, Any]) -> tuple[Any, list[float]]:
    """Train and evaluate as upstream; the unwrapped model (in eval weights) and each epoch's accuracy."""
    dist = faccel.detect(seed=config["seed"])  # the data order's seed (Accelerate's seedable sampler) ...
    faccel.set_seed(dist, config["seed"])  # ... and the generators' (the weights)
    train_set, eval_set = datasets()
    train_dataloader = DataLoader(train_set, batch_size=config["batch_size"], shuffle=True, drop_last=True)
    eval_dataloader = DataLoader(eval_set, batch_size=8)
    model = tiny_bert()
    optimizer = schedule_free_adamw(model, config)
    model, optimizer, train_dataloader, eval_dataloader = faccel.prepare(
        dist, model, optimizer, train_dataloader, eval_dataloader
    )
    accuracies = []
    for epoch in range(config["num_epochs"]):
        model.train()
        optimizer.train()  # schedule-free: the training weights
        for input_ids, labels in train_dataloader.at(epoch=epoch):
            loss = model(input_ids=input_ids, labels=labels).loss
            faccel.backward(dist, loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        optimizer.eval()  # schedule-free: the averaged weights, to evaluate (and save)
        correct = seen = 0
        for k, (input_ids, labels) in enumerate(eval_dataloader):
            with torch.no_grad():
                predictions = model(input_ids=input_ids).logits.argmax(dim=-1)
            predictions, references = faccel.gather_for_metrics(
                dist, (predictions, labels), eval_dataloader, batch=k
            )
            correct += int((predictions == references).sum())
            seen += len(references)
        accuracies.append(correct / seen)
        faccel.print(dist, f"epoch {epoch}: accuracy {correct / seen:.3f} over {seen} samples")
    faccel.shutdown(dist)
    return faccel.unwrap_model(model), accuracies


def main() -> None:
    model, _ = training_function(dict(CONFIG))
    if "--json" in sys.argv[1:]:
        print(json.dumps([p.detach().flatten().tolist() for p in model.parameters()]))


if __name__ == "__main__":
    main()
