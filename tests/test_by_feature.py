"""Accelerate's ``examples/by_feature`` ported to faccel, one test each (docs/from-accelerate.md).

Each port keeps the upstream script's shape (a model, an optimizer, a scheduler, a train and an
eval loader, one epoch loop) on a tiny model and synthetic data, and asserts its feature's outcome.
One process each; the multi-process features have their 2-rank tests in
tests/distributed/test_helpers.py (LocalSGD, comm hooks, profiler, batch size) and
tests/distributed/test_checkpoint_history.py (checkpoints). Not ported here: ``megatron_lm_gpt_pretraining``
(needs CUDA and Megatron-LM), ``deepspeed_with_config_support`` (tests/test_deepspeed_one_process.py
and tests/distributed/test_deepspeed.py, marked ``deepspeed``). ``schedule_free`` is a script,
examples/by_feature/schedule_free.py (it needs ``schedulefree``; skipped without it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

import faccel

ROOT = Path(__file__).resolve().parents[1]


def _data(n: int = 24, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=generator)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _setup(dist: faccel.DistState, *, batch_size: int = 4, n: int = 24, lr: float = 0.05) -> Any:
    faccel.set_seed(dist, 0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    train = DataLoader(_data(n), batch_size=batch_size, shuffle=True)
    evaluation = DataLoader(_data(10, seed=1), batch_size=4)
    model, optimizer, train, evaluation = faccel.prepare(dist, model, optimizer, train, evaluation)
    return model, optimizer, train, evaluation


def _epoch(dist: faccel.DistState, model: Any, optimizer: Any, loader: Any, scheduler: Any = None) -> float:
    total = 0.0
    for micro, (x, y) in faccel.micro_batches(dist, loader):
        with faccel.accumulate(dist, model, micro):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            faccel.backward(dist, loss, micro=micro)
        if micro.sync:
            faccel.optimizer_step(dist, optimizer, scheduler=scheduler)
            optimizer.zero_grad()
        total += loss.item()
    return total


def _accuracy(dist: faccel.DistState, model: Any, evaluation: Any) -> tuple[float, int]:
    correct = seen = 0
    with torch.no_grad():
        for k, (x, y) in enumerate(evaluation):
            predictions, labels = faccel.gather_for_metrics(
                dist, (model(x).argmax(1), y), evaluation, batch=k
            )
            correct += int((predictions == labels).sum())
            seen += len(labels)
    return correct / seen, seen


def _weights(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in faccel.unwrap_model(model).parameters()]


def _checkpointing(tmp_path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """checkpointing.py: save_state per epoch into ``out/epoch_N``; resume from ``out/epoch_0`` into a
    new root. The straight run's final weights and the resumed run's."""
    dist = faccel.detect({})
    model, optimizer, train, _ = _setup(dist)
    state = faccel.TrainState.create(model=model, optimizer=optimizer, loader=train)
    for epoch in range(2):
        _epoch(dist, model, optimizer, train.at(epoch=epoch))
        state = attrs.evolve(state, step=(epoch + 1) * len(train), epoch=epoch + 1)
        faccel.checkpoint(dist, state, tmp_path / "out", name=f"epoch_{epoch}")
    straight = _weights(model)
    again, optimizer2, train2, _ = _setup(faccel.detect({}))
    target = faccel.TrainState.create(model=again, optimizer=optimizer2, loader=train2)
    resumed = faccel.restore(dist, target, tmp_path / "out" / "epoch_0", into=tmp_path / "resumed")
    for epoch in range(resumed.epoch, 2):
        _epoch(dist, again, optimizer2, train2.at(epoch=epoch))
    return straight, _weights(again)


def test_checkpointing_epoch_folders_and_resume_from_epoch_0_bitwise(tmp_path: Path) -> None:
    """checkpointing.py: save_state per epoch into ``out/epoch_N``; resume from ``out/epoch_0``."""
    straight, resumed = _checkpointing(tmp_path)
    assert sorted(os.listdir(tmp_path / "out")) == ["epoch_0", "epoch_1"]
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))


def test_gradient_accumulation_steps_once_per_group() -> None:
    """gradient_accumulation.py: ``accumulate`` + ``sync_gradients``: one step per 2 batches."""
    dist = faccel.detect({}, accumulation_steps=2)
    model, optimizer, train, _ = _setup(dist)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=100)
    _epoch(dist, model, optimizer, train.at(epoch=0), scheduler)
    assert scheduler.last_epoch == faccel.steps_per_epoch(dist, train) == len(train) // 2


def _tokens() -> torch.Tensor:
    """Token ids with padding (-100): groups of 2 batches of 2 hold different numbers of counted tokens."""
    tokens = torch.randint(0, 5, (8, 6), generator=torch.Generator().manual_seed(0))
    tokens[::3, 3:] = -100
    return tokens


def test_gradient_accumulation_for_autoregressive_models_weighs_by_tokens() -> None:
    """..._for_autoregressive_models.py: the loss of a group is the mean over its counted tokens."""
    dist = faccel.detect({}, accumulation_steps=2)
    torch.manual_seed(0)
    tokens = _tokens()
    embed = torch.nn.Embedding(5, 5)
    model = faccel.prepare(dist, embed)
    loader = faccel.prepare(dist, DataLoader(TensorDataset(tokens), batch_size=2))
    grads = []
    for micro, (batch,) in faccel.micro_batches(
        dist, loader.at(epoch=0), items=lambda b: int((b[0] != -100).sum())
    ):
        logits = model(batch.clamp(min=0))
        loss_sum = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 5), batch.reshape(-1), ignore_index=-100, reduction="sum"
        )
        faccel.backward(dist, loss_sum, micro=micro, items=micro.items)
        if micro.sync:
            grads.append(embed.weight.grad.clone())
            embed.weight.grad = None
    # The reference: each group of 2 batches as one batch, the mean over its counted tokens.
    for group, grad in enumerate(grads):
        whole = tokens[group * 4 : group * 4 + 4]
        embed.weight.grad = None
        torch.nn.functional.cross_entropy(
            embed(whole.clamp(min=0)).reshape(-1, 5), whole.reshape(-1), ignore_index=-100
        ).backward()
        torch.testing.assert_close(grad, embed.weight.grad)


def test_memory_find_executable_batch_size_builds_the_loop_at_the_size_that_fits() -> None:
    """memory.py: ``find_executable_batch_size`` around the whole training function."""
    dist = faccel.detect({})

    @faccel.find_executable_batch_size(dist, starting_batch_size=16)
    def training_function(batch_size: int) -> int:
        if batch_size > 9:  # what a too-large batch does on a GPU
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        model, optimizer, train, _ = _setup(dist, batch_size=batch_size)
        _epoch(dist, model, optimizer, train.at(epoch=0))
        return train.batch_size

    assert training_function() == 9  # 16 -> 14 -> 12 -> 10 -> 9


def test_automatic_gradient_accumulation_keeps_the_observed_batch() -> None:
    """automatic_gradient_accumulation.py: the batch that fits times accumulation = the observed batch."""
    observed = 16
    found = []

    @faccel.find_executable_batch_size(faccel.detect({}), starting_batch_size=observed)
    def training_function(batch_size: int) -> None:
        if batch_size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        dist = faccel.detect({}, accumulation_steps=observed // batch_size)
        model, optimizer, train, _ = _setup(dist, batch_size=batch_size, n=32)
        _epoch(dist, model, optimizer, train.at(epoch=0))
        found.append((batch_size, dist.accumulation_steps, faccel.steps_per_epoch(dist, train)))

    training_function()
    assert found == [(8, 2, 2)]  # 16 -> 14 -> 12 -> 10 -> 9 -> 8: 2 micro-batches of 8, 32 samples


def test_local_sgd_in_one_process_trains_as_plain() -> None:
    """local_sgd.py: ``with LocalSGD(...) as local_sgd: ... local_sgd.step()`` (2 ranks: test_helpers)."""
    dist = faccel.detect({})
    model, optimizer, train, _ = _setup(dist)
    with faccel.local_sgd(dist, model, every=4) as local:
        for step, (x, y) in enumerate(train.at(epoch=0), start=1):
            faccel.backward(dist, torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            local.step(step)
    plain, optimizer2, train2, _ = _setup(faccel.detect({}))
    for x, y in train2.at(epoch=0):
        faccel.backward(dist, torch.nn.functional.cross_entropy(plain(x), y))
        optimizer2.step()
        optimizer2.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), _weights(plain), strict=True))


def test_multi_process_metrics_counts_every_sample_once() -> None:
    """multi_process_metrics.py: ``gather_for_metrics`` drops the padding: 10 samples, 10 results."""
    dist = faccel.detect({})
    model, optimizer, train, evaluation = _setup(dist)
    _epoch(dist, model, optimizer, train.at(epoch=0))
    accuracy, seen = _accuracy(dist, model, evaluation)
    assert seen == 10 and 0.0 <= accuracy <= 1.0


def test_tracking_logs_one_record_per_epoch(tmp_path: Path) -> None:
    """tracking.py: ``init_trackers`` / ``log`` / ``end_training`` with a config."""
    dist = faccel.detect({})
    model, optimizer, train, evaluation = _setup(dist)
    tracker = faccel.init_tracker(dist, tmp_path, kind="jsonl", project="tracking", config={"lr": 0.05})
    for epoch in range(2):
        total = _epoch(dist, model, optimizer, train.at(epoch=epoch))
        accuracy, _ = _accuracy(dist, model, evaluation)
        faccel.log(dist, tracker, epoch, {"accuracy": accuracy, "train_loss": total / len(train)})
    faccel.end_training(dist, tracker)
    lines = [json.loads(line) for path in tmp_path.rglob("*.jsonl") for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines if "accuracy" in str(line)] == [0, 1]


def test_cross_validation_trains_each_fold_and_averages_the_predictions() -> None:
    """cross_validation.py: k folds, a fresh model each, the test predictions averaged over the folds."""
    dist = faccel.detect({})
    data = _data(24)
    folds = 3
    test = faccel.prepare(dist, DataLoader(_data(10, seed=1), batch_size=4))
    summed = torch.zeros(10, 2)
    for fold in range(folds):
        train_ids = [i for i in range(24) if i % folds != fold]
        faccel.set_seed(dist, fold)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        train = DataLoader(Subset(data, train_ids), batch_size=4, shuffle=True)
        model, optimizer, train = faccel.prepare(dist, model, optimizer, train)
        _epoch(dist, model, optimizer, train.at(epoch=0))
        with torch.no_grad():
            logits = torch.cat([model(x) for x, _ in test])
        summed += faccel.gather_for_metrics(dist, logits, test)
    assert summed.shape == (10, 2) and torch.isfinite(summed).all()


def test_early_stopping_stops_every_rank_at_the_same_step() -> None:
    """early_stopping.py: ``set_trigger`` / ``check_trigger`` as one ``any_rank`` value."""
    dist = faccel.detect({})
    model, optimizer, train, _ = _setup(dist)
    stopped_at = None
    for step, (x, y) in enumerate(train.at(epoch=0)):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        faccel.backward(dist, loss)
        optimizer.step()
        optimizer.zero_grad()
        if faccel.any_rank(dist, step == 2):  # the upstream script's "loss < threshold"
            stopped_at = step
            break
    assert stopped_at == 2


def test_fsdp_with_peak_memory_tracking_in_one_process(tmp_path: Path) -> None:
    """fsdp_with_peak_mem_tracking.py: strategy='fsdp' (one process: nothing sharded) and the peak logged."""
    import tracemalloc

    dist = faccel.detect({}, strategy="fsdp")
    model, optimizer, train, _ = _setup(dist)
    tracker = faccel.init_tracker(dist, tmp_path, kind="jsonl", project="fsdp")
    tracemalloc.start()
    _epoch(dist, model, optimizer, train.at(epoch=0))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    faccel.log(dist, tracker, 0, {"train_peak_bytes": peak})
    faccel.end_training(dist, tracker)
    assert peak > 0


def test_profiler_writes_a_chrome_trace(tmp_path: Path) -> None:
    """profiler.py: ``accelerator.profile(ProfileKwargs(...))``; 2 ranks: test_helpers."""
    dist = faccel.detect({})
    model, optimizer, train, _ = _setup(dist)
    with faccel.profile(dist, tmp_path, record_shapes=True) as prof:
        _epoch(dist, model, optimizer, train.at(epoch=0))
    assert (tmp_path / "profile_0.json").stat().st_size > 0 and prof.key_averages()


def test_ddp_comm_hook_through_prepare_in_one_process() -> None:
    """ddp_comm_hook.py: ``DistributedDataParallelKwargs(comm_hook=...)``: a no-op without peers."""
    dist = faccel.detect({})
    faccel.set_seed(dist, 0)
    model = faccel.prepare(
        dist, _model(), comm_hook="powersgd", comm_hook_options={"matrix_approximation_rank": 1}
    )
    assert isinstance(model, torch.nn.Sequential)


def _tiny_bert() -> Iterator[Any]:
    transformers = pytest.importorskip("transformers")
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
    yield transformers.BertForSequenceClassification(config)


def _nlp_data() -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (24, 8), generator=generator)
    labels = (ids[:, 0] > 25).long()
    return TensorDataset(ids, labels), TensorDataset(ids[:10], labels[:10])


def _complete_nlp(tmp_path: Path) -> list[torch.Tensor]:
    """complete_nlp_example.py: a classifier, a linear schedule, evaluation, a checkpoint per epoch."""
    dist = faccel.detect({})
    faccel.set_seed(dist, 0)
    model = next(_tiny_bert())
    train_set, eval_set = _nlp_data()
    train = DataLoader(train_set, batch_size=4, shuffle=True)
    evaluation = DataLoader(eval_set, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, train, evaluation = faccel.prepare(dist, model, optimizer, train, evaluation)
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, 1.0, 0.0, total_iters=faccel.steps_per_epoch(dist, train)
    )
    state = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler, loader=train)
    for x, y in train.at(epoch=0):
        faccel.backward(dist, model(input_ids=x, labels=y).loss)
        faccel.optimizer_step(dist, optimizer, scheduler=scheduler)
        optimizer.zero_grad()
    seen = 0
    with torch.no_grad():
        for k, (x, y) in enumerate(evaluation):
            _, references = faccel.gather_for_metrics(
                dist, (model(input_ids=x).logits.argmax(-1), y), evaluation, batch=k
            )
            seen += len(references)
    state = attrs.evolve(state, step=len(train), epoch=1)
    folder = faccel.checkpoint(dist, state, tmp_path, name="epoch_0")
    assert seen == 10 and (folder / "model.safetensors").is_file() and scheduler.last_epoch == len(train)
    return _weights(model)


def test_complete_nlp_example_tiny_bert_trains_evaluates_and_checkpoints(tmp_path: Path) -> None:
    """complete_nlp_example.py: a classifier, a linear schedule, evaluation, a checkpoint per epoch."""
    assert len(_complete_nlp(tmp_path)) > 0  # _complete_nlp asserts the example's outcomes


def _final_weights(*command: str) -> list[list[float]]:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=300, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_schedule_free_ends_with_accelerates_weights_bitwise() -> None:
    """schedule_free.py: ``optimizer.train()`` / ``optimizer.eval()`` around the loops; the port and
    Accelerate's run of the same loop end with the same evaluation weights, bit for bit."""
    pytest.importorskip("schedulefree", reason="the example needs schedulefree (pip install schedulefree)")
    pytest.importorskip("transformers", reason="the example's tiny BERT needs transformers")
    pytest.importorskip("accelerate", reason="the comparison runs Accelerate (not in the test extra)")
    ours = _final_weights("examples/by_feature/schedule_free.py", "--json")
    theirs = _final_weights("tests/by_feature_accelerate.py", "schedule_free")
    assert len(ours) == len(theirs) > 0 and ours == theirs


def _plain_port(
    *,
    batch_size: int = 4,
    n: int = 24,
    epochs: int = 1,
    steps: int = 1,
    evaluate: bool = False,
    **prepare: Any,
) -> list[torch.Tensor]:
    """The ports' shared loop, as tests/by_feature_accelerate.py ``_plain`` runs it under Accelerate."""
    dist = faccel.detect({}, accumulation_steps=steps)
    faccel.set_seed(dist, 0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    train = DataLoader(_data(n), batch_size=batch_size, shuffle=True)
    evaluation = DataLoader(_data(10, seed=1), batch_size=4)
    model, optimizer, train, evaluation = faccel.prepare(dist, model, optimizer, train, evaluation, **prepare)
    for epoch in range(epochs):
        _epoch(dist, model, optimizer, train.at(epoch=epoch))
        if evaluate:
            _accuracy(dist, model, evaluation)
    return _weights(model)


def _early_stopping_port() -> list[torch.Tensor]:
    dist = faccel.detect({})
    model, optimizer, train, _ = _setup(dist)
    for step, (x, y) in enumerate(train.at(epoch=0)):
        faccel.backward(dist, torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if faccel.any_rank(dist, step == 2):
            break
    return _weights(model)


def _cross_validation_port() -> list[torch.Tensor]:
    data = _data(24)
    out: list[torch.Tensor] = []
    for fold in range(3):
        # set_seed(fold) seeds Accelerate's seedable sampler too; faccel's data order follows detect(seed=).
        dist = faccel.detect({}, seed=fold)
        faccel.set_seed(dist, fold)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        train_ids = [i for i in range(24) if i % 3 != fold]
        train = DataLoader(Subset(data, train_ids), batch_size=4, shuffle=True)
        model, optimizer, train = faccel.prepare(dist, model, optimizer, train)
        _epoch(dist, model, optimizer, train.at(epoch=0))
        out += _weights(model)
    return out


def _autoregressive_port() -> list[torch.Tensor]:
    dist = faccel.detect({}, accumulation_steps=2)
    faccel.set_seed(dist, 0)
    tokens = _tokens()
    model = torch.nn.Embedding(5, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, loader = faccel.prepare(
        dist, model, optimizer, DataLoader(TensorDataset(tokens), batch_size=2)
    )
    for micro, (batch,) in faccel.micro_batches(
        dist, loader.at(epoch=0), items=lambda b: int((b[0] != -100).sum())
    ):
        with faccel.accumulate(dist, model, micro):
            loss_sum = torch.nn.functional.cross_entropy(
                model(batch.clamp(min=0)).reshape(-1, 5),
                batch.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            faccel.backward(dist, loss_sum, micro=micro, items=micro.items)
        if micro.sync:
            optimizer.step()
            optimizer.zero_grad()
    return _weights(model)


def _profiler_port(tmp_path: Path) -> list[torch.Tensor]:
    dist = faccel.detect({})
    model, optimizer, train, _ = _setup(dist)
    with faccel.profile(dist, tmp_path / "trace", record_shapes=True):
        _epoch(dist, model, optimizer, train.at(epoch=0))
    return _weights(model)


# Each port that trains, as its Accelerate twin (tests/by_feature_accelerate.py TWINS) runs it. The
# seedable sampler draws the shuffle from seed + epoch as a prepared faccel loader does. Not here:
# fsdp_with_peak_mem_tracking (Accelerate's FSDP plugin wants a distributed run; faccel's one-process
# "fsdp" shards nothing, so it is the plain loop), schedule_free (its own test above).
_PORTS: dict[str, Any] = {
    "gradient_accumulation": lambda tmp: _plain_port(epochs=2, steps=2),  # every group full: 6 batches
    "local_sgd": lambda tmp: _plain_port(epochs=2),  # one process: LocalSGD's loop is the plain one
    "checkpointing": lambda tmp: _checkpointing(tmp)[1],  # the run resumed from epoch_0
    "memory": lambda tmp: _plain_port(batch_size=9),  # the size find_executable_batch_size settles on
    "automatic_gradient_accumulation": lambda tmp: _plain_port(batch_size=8, n=32, steps=2),
    "multi_process_metrics": lambda tmp: _plain_port(evaluate=True),
    "tracking": lambda tmp: _plain_port(epochs=2, evaluate=True),
    "cross_validation": lambda tmp: _cross_validation_port(),
    "early_stopping": lambda tmp: _early_stopping_port(),
    "gradient_accumulation_for_autoregressive_models": lambda tmp: _autoregressive_port(),
    "complete_nlp_example": _complete_nlp,
    "profiler": _profiler_port,
    "ddp_comm_hook": lambda tmp: _plain_port(comm_hook="powersgd"),
}


@pytest.fixture(scope="module")
def accelerate_twins() -> dict[str, list[list[float]]]:
    """Every twin's final weights from one Accelerate process."""
    pytest.importorskip("accelerate", reason="the comparison runs Accelerate (not in the test extra)")
    pytest.importorskip("transformers", reason="complete_nlp_example's tiny BERT needs transformers")
    return _final_weights("tests/by_feature_accelerate.py", "all")  # type: ignore[return-value]


@pytest.mark.parametrize("example", sorted(_PORTS))
def test_each_port_ends_with_its_accelerate_twins_weights_bitwise(
    accelerate_twins: dict[str, list[list[float]]], example: str, tmp_path: Path
) -> None:
    ours = [p.flatten().tolist() for p in _PORTS[example](tmp_path)]
    assert len(ours) == len(accelerate_twins[example]) > 0 and ours == accelerate_twins[example]
