"""Handwritten digits: a small CNN on scikit-learn's bundled digits, in one process or several.

python examples/digits.py
torchrun --standalone --nproc-per-node 2 examples/digits.py

Interrupted and resumed (the second run is a new process that restores the
checkpoint and ends with the same weights as a run that never stopped):

python examples/digits.py --checkpoint-dir ckpt --stop-after-steps 100
python examples/digits.py --checkpoint-dir ckpt --resume

The 1,797 8x8 images of ``sklearn.datasets.load_digits`` ship with
scikit-learn (no download; ``pip install scikit-learn`` or ``.[examples]``).
A fixed permutation splits them 80/20; the test accuracy is computed by
``faccel.gather_for_metrics`` over exactly the 360 test images, whatever the
number of processes. The last lines give the weights' SHA-256 and the test
accuracy.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import sys
import time
from pathlib import Path

import attrs
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel

SEED = 0
TEST_FRACTION = 0.2


@attrs.frozen(kw_only=True)
class Outcome:
    """What a run ends with; ``accuracy`` is None when it stopped early (``--stop-after-steps``)."""

    step: int
    epoch: int
    position: int
    world_size: int
    accuracy: float | None
    test_samples: int
    weights_sha256: str
    seconds: float


def load_split(seed: int = SEED) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets of standardised 1x8x8 images and their labels, the same in every process."""
    from sklearn.datasets import load_digits  # read from scikit-learn's package data, no download

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8), 0..16
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test_size = math.ceil(TEST_FRACTION * len(labels))
    test, train = order[:test_size], order[test_size:]
    # The training images' statistics only: the test set stays unseen.
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def make_model() -> nn.Module:
    """Two 3x3 convolutions (16 and 32 channels), 2x2 max pooling, and a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 of the unwrapped model's tensors, in ``state_dict`` order: equal hashes, equal bits."""
    digest = hashlib.sha256()
    for tensor in faccel.unwrap_model(model).state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def evaluate(dist: faccel.DistState, model: nn.Module, loader: faccel.PreparedLoader) -> tuple[float, int]:
    """(accuracy, samples counted) over the whole test set, on every rank."""
    model.eval()
    predictions, labels = [], []
    with torch.no_grad():
        for inputs, targets in loader:
            predictions.append(model(inputs).argmax(dim=1))
            labels.append(targets)
    model.train()
    # One collective for the whole evaluation; the padding samples (repeated so that
    # every rank has as many batches) are dropped, so each test image counts once.
    predicted, expected = faccel.gather_for_metrics(dist, (torch.cat(predictions), torch.cat(labels)), loader)
    return (predicted == expected).float().mean().item(), len(expected)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train (default 10)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per process (default 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default 3e-3)")
    parser.add_argument("--checkpoint-dir", type=Path, help="checkpoint here after every epoch (keep 2)")
    parser.add_argument("--resume", action="store_true", help="restore the latest checkpoint, if any")
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        metavar="N",
        help="checkpoint and stop after optimizer step N, as if the job were preempted",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if (args.resume or args.stop_after_steps is not None) and args.checkpoint_dir is None:
        parser.error("--resume and --stop-after-steps need --checkpoint-dir")
    return args


def main(argv: list[str] | None = None) -> Outcome:
    args = parse_args(argv)
    begin = time.perf_counter()
    dist = faccel.detect()  # reads torchrun's variables; starts gloo (CPU) or NCCL for > 1 process
    log = faccel.get_logger(dist, __name__)  # "[rank 0/2] ...", on the main process only

    train_data, test_data = load_split()
    faccel.set_seed(dist, SEED)  # identical initial weights on every rank
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer, loader, test_loader = faccel.prepare(
        dist,
        model,
        optimizer,
        DataLoader(train_data, batch_size=args.batch_size, shuffle=True),
        DataLoader(test_data, batch_size=128),
    )
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    log.info(
        "digits: %d training and %d test images; world size %d, %d batches of %d per rank per epoch",
        len(train_data),
        len(test_data),
        dist.world_size,
        len(loader),
        args.batch_size,
    )
    if args.resume:
        latest = faccel.latest_checkpoint(args.checkpoint_dir)
        if latest is None:
            log.info("no checkpoint in %s: starting from the beginning", args.checkpoint_dir)
        else:
            state = faccel.restore(dist, state, args.checkpoint_dir)  # loads model and Adam in place
            log.info(
                "restored %s: step %d, epoch %d, batch %d",
                latest.name,
                state.step,
                state.epoch,
                state.position,
            )

    loss = torch.zeros(())
    for epoch in range(state.epoch, args.epochs):
        # A resumed run starts at the saved batch; the end of each epoch sets the position back to 0.
        batches = faccel.progress(
            dist,
            loader.at(epoch=epoch, start=state.position),
            desc=f"epoch {epoch}",
            leave=False,
            disable=args.no_progress,
        )
        for inputs, targets in batches:
            state.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(state.model(inputs), targets)
            faccel.backward(dist, loss)
            state.optimizer.step()
            state = attrs.evolve(state, step=state.step + 1, position=state.position + 1)
            if state.step == args.stop_after_steps:
                saved = faccel.checkpoint(dist, state, args.checkpoint_dir, keep=2)
                log.info(
                    "stopped after step %d (epoch %d, batch %d); checkpoint %s",
                    state.step,
                    state.epoch,
                    state.position,
                    saved,
                )
                # "Preempted": stop before fetching another batch.
                return _finish(dist, state, accuracy=None, test_samples=0, begin=begin, log=log)
        # The epoch is done: the state says "epoch + 1, batch 0", so a restore starts there.
        state = attrs.evolve(state, epoch=epoch + 1, position=0)
        if args.checkpoint_dir is not None:
            # replace: a run stopped after an epoch's last batch saved this step as "epoch, batch
            # len"; resumed, it reaches the same point and saves it again as "epoch + 1, batch 0".
            faccel.checkpoint(dist, state, args.checkpoint_dir, keep=2, replace=True)
        accuracy, _ = evaluate(dist, state.model, test_loader)
        mean_loss = faccel.reduce(dist, loss.detach(), op="mean")  # the last batch's loss, over ranks
        log.info("epoch %d: loss %.4f, test accuracy %.4f", epoch, mean_loss.item(), accuracy)

    accuracy, counted = evaluate(dist, state.model, test_loader)
    return _finish(dist, state, accuracy=accuracy, test_samples=counted, begin=begin, log=log)


def _finish(
    dist: faccel.DistState,
    state: faccel.TrainState,
    *,
    accuracy: float | None,
    test_samples: int,
    begin: float,
    log: logging.LoggerAdapter,  # type: ignore[type-arg]
) -> Outcome:
    outcome = Outcome(
        step=state.step,
        epoch=state.epoch,
        position=state.position,
        world_size=dist.world_size,
        accuracy=accuracy,
        test_samples=test_samples,
        weights_sha256=weights_sha256(state.model),
        seconds=time.perf_counter() - begin,
    )
    log.info("%d steps in %.1f s; weights sha256 %s", outcome.step, outcome.seconds, outcome.weights_sha256)
    if accuracy is not None:
        log.info("test accuracy %.4f on %d samples (world size %d)", accuracy, test_samples, dist.world_size)
    faccel.shutdown(dist)
    return outcome


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main()
