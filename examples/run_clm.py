"""Causal language modelling on a text file: transformers' ``run_clm_no_trainer.py``, ported to faccel.

python examples/run_clm.py --train_file train.txt --tokenizer_name TOKENIZER_DIR \\
    --model_type gpt2 --config_overrides n_layer=2,n_embd=32,n_head=2 --block_size 32 \\
    --checkpointing_steps 10 --with_tracking --output_dir out
torchrun --standalone --nproc-per-node 2 examples/run_clm.py ... (the same arguments)
python examples/run_clm.py ... --resume_from_checkpoint out/checkpoints

The structure and the argument names are those of the Accelerate script (argparse, a tokenizer,
``group_texts`` into ``block_size`` chunks, ``default_data_collator``, AdamW with weight-decay
groups, ``get_scheduler``, accumulation, ``--checkpointing_steps``, ``--resume_from_checkpoint``,
perplexity, trackers, the model saved at the end). What differs, on purpose:

* the loss of an optimizer step is the mean over every token of its micro-batches on every rank
  (``faccel.backward(dist, loss_sum, micro=micro, items=n)``), not a mean of per-batch means;
* the scheduler advances once per optimizer step at any world size, sized after ``prepare``;
* ``--resume_from_checkpoint`` restores the exact position (mid-epoch included), generators and
  tracking sums: a resumed run ends with the uninterrupted run's weights, bit for bit;
* the perplexity is over exactly the evaluation set's tokens at any world size (the padding the
  loader adds to give every rank as many batches is dropped by ``gather_for_metrics``);
* SIGTERM/SIGUSR1 (``faccel.stop_signal``) checkpoint at the next optimizer step and exit 0;
* offline: ``--train_file`` (one text a line) and a local ``--tokenizer_name`` folder; no hub,
  no ``datasets`` (the text loader, tokenisation and ``group_texts`` are plain Python here).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import attrs
import torch
import transformers
from torch.utils.data import DataLoader
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    SchedulerType,
    default_data_collator,
    get_scheduler,
)
from transformers.trainer_pt_utils import get_parameter_names

import faccel

logger = faccel.get_logger(__name__)  # reads the rank at each call: made before any DistState


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a causal language model on a text file with faccel")
    parser.add_argument("--train_file", type=str, required=True, help="A text file, one text per line.")
    parser.add_argument("--validation_file", type=str, default=None, help="A text file, one text per line.")
    parser.add_argument(
        "--validation_split_percentage",
        type=int,
        default=5,
        help="Lines of the training file used for validation when there is no validation file.",
    )
    parser.add_argument("--model_name_or_path", type=str, default=None, help="A local pretrained model.")
    parser.add_argument("--config_name", type=str, default=None, help="A local config, if not the model's.")
    parser.add_argument("--tokenizer_name", type=str, default=None, help="A local tokenizer folder.")
    parser.add_argument("--use_slow_tokenizer", action="store_true", help="Use a slow (Python) tokenizer.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--max_train_steps", type=int, default=None, help="Overrides --num_train_epochs.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument(
        "--lr_scheduler_type",
        type=SchedulerType,
        default="linear",
        choices=[
            "linear",
            "cosine",
            "cosine_with_restarts",
            "polynomial",
            "constant",
            "constant_with_warmup",
        ],
    )
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument(
        "--mixed_precision",
        type=str,
        default=None,
        choices=["no", "bf16", "fp16"],
        help="Autocast precision (default: $FACCEL_PRECISION, else no); Accelerate's --mixed_precision.",
    )
    parser.add_argument("--max_grad_norm", type=float, default=None, help="Clip gradients to this norm.")
    parser.add_argument("--output_dir", type=str, default=None, help="Where to store the final model.")
    parser.add_argument("--seed", type=int, default=None, help="Seeds the weights and the data order.")
    parser.add_argument("--model_type", type=str, default=None, choices=sorted(CONFIG_MAPPING.keys()))
    parser.add_argument(
        "--config_overrides",
        type=str,
        default=None,
        help="Overrides of a new model's config, e.g. n_layer=2,n_embd=32,n_head=2 (as run_clm.py).",
    )
    parser.add_argument("--block_size", type=int, default=None, help="Tokens per training sequence.")
    parser.add_argument(
        "--checkpointing_steps",
        type=str,
        default=None,
        help="Checkpoint every n optimizer steps ('10'), or at the end of each epoch ('epoch').",
    )
    parser.add_argument(
        "--resume_from_checkpoint",
        type=str,
        default=None,
        help="A checkpoint folder, or a folder of them (the latest complete one is restored).",
    )
    parser.add_argument("--with_tracking", action="store_true", help="Record metrics with a tracker.")
    parser.add_argument(
        "--report_to",
        type=str,
        default="jsonl",
        help="jsonl (default), csv, tensorboard, wandb, mlflow, or all.",
    )
    parser.add_argument(
        "--kill_at_step",
        type=int,
        default=None,
        help="(testing) SIGKILL every rank right after this step's checkpoint: a hard preemption.",
    )
    args = parser.parse_args(argv)
    if args.model_name_or_path is None and args.model_type is None and args.config_name is None:
        parser.error("a new model needs --model_type (or --config_name), or pass --model_name_or_path")
    if args.tokenizer_name is None and args.model_name_or_path is None:
        parser.error("pass --tokenizer_name (a local tokenizer folder) or --model_name_or_path")
    if args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    return args


def load_texts(args: argparse.Namespace) -> dict[str, list[str]]:
    """The ``text`` loader of ``datasets``: one example a line; a validation split cut off the front."""

    def lines(path: str) -> list[str]:
        return Path(path).read_text(encoding="utf-8").splitlines()

    train = lines(args.train_file)
    if args.validation_file is not None:
        return {"train": train, "validation": lines(args.validation_file)}
    cut = len(train) * args.validation_split_percentage // 100
    return {"train": train[cut:], "validation": train[:cut]}


def build_tokenizer_and_model(args: argparse.Namespace) -> tuple[Any, torch.nn.Module]:
    if args.config_name:
        config = AutoConfig.from_pretrained(args.config_name)
    elif args.model_name_or_path:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
    else:
        config = CONFIG_MAPPING[args.model_type]()
        logger.warning("You are instantiating a new config instance from scratch.")
        if args.config_overrides is not None:
            logger.info(f"Overriding config: {args.config_overrides}")
            config.update_from_string(args.config_overrides)
    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer_name or args.model_name_or_path, use_fast=not args.use_slow_tokenizer
    )
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=config)
    else:
        logger.info("Training new model from scratch")
        model = AutoModelForCausalLM.from_config(config)
    # Resize the embeddings only when necessary, to avoid index errors.
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))
    return tokenizer, model


def group_texts(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """Concatenate the texts and cut them into ``block_size`` chunks (the small remainder is dropped)."""
    concatenated = {k: list(itertools.chain.from_iterable(examples[k])) for k in examples}
    total_length = len(concatenated[next(iter(examples))])
    total_length = (total_length // block_size) * block_size
    result = {
        k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
        for k, t in concatenated.items()
    }
    result["labels"] = [list(ids) for ids in result["input_ids"]]
    return result


def lm_dataset(texts: list[str], tokenizer: Any, block_size: int) -> list[dict[str, list[int]]]:
    """``datasets.map(tokenize)`` then ``map(group_texts)``, batched by 1,000 texts as there."""
    rows: list[dict[str, list[int]]] = []
    for first in range(0, len(texts), 1000):
        encoded = dict(tokenizer(texts[first : first + 1000]))
        grouped = group_texts(encoded, block_size)
        rows.extend(dict(zip(grouped, values, strict=True)) for values in zip(*grouped.values(), strict=True))
    return rows


def block_size_of(args: argparse.Namespace, tokenizer: Any) -> int:
    if args.block_size is None:
        block_size = min(tokenizer.model_max_length, 1024)
        if tokenizer.model_max_length > 1024:
            logger.warning(f"Tokenizer model_max_length {tokenizer.model_max_length} > 1024: using 1024.")
        return block_size
    if args.block_size > tokenizer.model_max_length:
        logger.warning(f"block_size {args.block_size} > the model's {tokenizer.model_max_length}: using it.")
    return min(args.block_size, tokenizer.model_max_length)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weight decay on the weights, none on biases and norms (as the Trainer decides)."""
    forbidden = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], forbidden_layer_names=forbidden))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def predicted_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of a batch that carry a loss: each but the first of a block (labels shift by one)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed next-token loss and its number of predicted tokens."""
    shifted = labels[:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), shifted, ignore_index=-100, reduction="none"
    )
    return losses.sum(dim=1), (shifted != -100).sum(dim=1)


def evaluate(
    dist: faccel.DistState, model: torch.nn.Module, loader: faccel.PreparedLoader
) -> tuple[float, float, int]:
    """(eval_loss, perplexity, tokens) over every token of the evaluation set, at any world size."""
    model.eval()
    sums, counts = [], []
    for k, batch in enumerate(loader):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # One row per sample of this rank's batch k; the padding samples are dropped by position.
        loss_sum, count = faccel.gather_for_metrics(
            dist, token_losses(logits, batch["labels"]), loader, batch=k
        )
        sums.append(loss_sum)
        counts.append(count)
    model.train()
    tokens = int(torch.cat(counts).sum())
    eval_loss = torch.cat(sums).double().sum().item() / max(tokens, 1)
    try:
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    return eval_loss, perplexity, tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; the results (perplexity, eval_loss, eval_tokens, step) and the trained ``model``."""
    args = parse_args(argv)
    # The data order follows dist.seed (a function of seed and epoch, the same on every rank).
    seed = args.seed if args.seed is not None else 0
    dist = faccel.detect(
        accumulation_steps=args.gradient_accumulation_steps, precision=args.mixed_precision, seed=seed
    )
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
    )
    logger.info(f"{dist}")
    if dist.is_local_main_process:
        transformers.utils.logging.set_verbosity_warning()
    else:
        transformers.utils.logging.set_verbosity_error()
    if args.seed is not None:
        faccel.set_seed(dist, args.seed)  # the initial weights (and dropout): the same on every rank

    raw = load_texts(args)
    with faccel.main_process_first(dist):
        tokenizer, model = build_tokenizer_and_model(args)
        block_size = block_size_of(args, tokenizer)
        train_dataset = lm_dataset(raw["train"], tokenizer, block_size)
        eval_dataset = lm_dataset(raw["validation"], tokenizer, block_size)
    logger.info(
        f"{len(train_dataset)} training and {len(eval_dataset)} evaluation blocks of {block_size} tokens"
    )

    train_dataloader = DataLoader(
        train_dataset,
        shuffle=True,
        collate_fn=default_data_collator,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )
    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.learning_rate)
    model, optimizer, train_dataloader, eval_dataloader = faccel.prepare(
        dist, model, optimizer, train_dataloader, eval_dataloader
    )

    # After prepare: this rank's optimizer steps per epoch (its shard, over the accumulation steps).
    num_update_steps_per_epoch = faccel.steps_per_epoch(dist, train_dataloader)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    # Stepped once per optimizer step at any world size: no `* num_processes` here.
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.max_train_steps,
    )
    checkpointing_steps: int | str | None = args.checkpointing_steps
    if isinstance(checkpointing_steps, str) and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    root = Path(args.output_dir or ".") / "checkpoints"

    scaler = faccel.grad_scaler(dist)  # a pass-through unless --mixed_precision fp16
    # The per-rank sums behind the epoch's train_loss ride in the checkpoint, so a resumed run logs
    # the same numbers.
    state = faccel.TrainState.create(
        model=model,
        optimizer=optimizer,
        scheduler=lr_scheduler,
        scaler=scaler,
        loader=train_dataloader,
        rank_extras={"loss_sum": 0.0, "tokens": 0},
    )
    if args.resume_from_checkpoint:
        state = faccel.restore(dist, state, args.resume_from_checkpoint)
        logger.info(
            f"Resumed from checkpoint: step {state.step}, epoch {state.epoch}, batch {state.position}"
        )

    tracker = None
    if args.with_tracking:
        config = {k: v.value if isinstance(v, SchedulerType) else v for k, v in vars(args).items()}
        tracker = faccel.init_tracker(
            dist, Path(args.output_dir or "."), kind=args.report_to, project="clm_no_trainer", config=config
        )

    total_batch_size = (
        args.per_device_train_batch_size * dist.data_world_size * args.gradient_accumulation_steps
    )
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Num Epochs = {args.num_train_epochs}")
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")

    def save(state: faccel.TrainState) -> None:
        faccel.checkpoint(dist, state, root, keep=2)
        logger.info(f"checkpointed step {state.step} (epoch {state.epoch}, batch {state.position})")
        if args.kill_at_step == state.step:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: as a node lost mid-run

    eval_loss = perplexity = float("nan")
    eval_tokens = 0
    stop = faccel.stop_signal(dist)
    model.train()
    for epoch in range(state.epoch, args.num_train_epochs):
        if state.step >= args.max_train_steps:
            break
        if epoch != state.epoch:  # a new epoch: from its first batch, with fresh sums
            state = attrs.evolve(state, epoch=epoch, position=0, rank_extras={"loss_sum": 0.0, "tokens": 0})
        view = faccel.progress(dist, train_dataloader.resume(state), desc=f"epoch {epoch}")
        for micro, batch in faccel.micro_batches(dist, view, items=predicted_tokens):
            n = predicted_tokens(batch)
            with faccel.accumulate(dist, model, micro):  # DDP's no_sync unless micro.sync
                # num_items_in_batch=1: the model's loss is the sum over the batch's tokens, which
                # backward divides by the step's token count over every micro-batch and rank.
                loss = model(**batch, num_items_in_batch=1).loss
                faccel.backward(dist, loss, micro=micro, items=n, scaler=scaler)
            state = attrs.evolve(state, position=state.position + 1)
            if tracker is not None:  # .item() waits for the device: only when tracking
                sums = state.rank_extras
                rank_extras = {"loss_sum": sums["loss_sum"] + loss.item(), "tokens": sums["tokens"] + n}
                state = attrs.evolve(state, rank_extras=rank_extras)
            if not micro.sync:
                continue
            if args.max_grad_norm is not None:
                faccel.clip_grad_norm(dist, model, args.max_grad_norm, scaler=scaler, optimizer=optimizer)
            # Under fp16 a step with inf/NaN gradients is skipped, and the scheduler waits with it.
            faccel.optimizer_step(dist, optimizer, scaler=scaler, scheduler=lr_scheduler)
            optimizer.zero_grad()
            state = attrs.evolve(state, step=state.step + 1)
            if tracker is not None:
                faccel.log(dist, tracker, state.step, {"loss": loss.detach() / max(n, 1)}, reduce="mean")
                faccel.log(dist, tracker, state.step, {"learning_rate": optimizer.param_groups[0]["lr"]})
            stopping = faccel.any_rank(dist, stop.received)  # the same answer on every rank
            if stopping or (isinstance(checkpointing_steps, int) and state.step % checkpointing_steps == 0):
                save(state)
            if stopping:
                logger.info(
                    f"stopped by a signal at step {state.step}; resume with --resume_from_checkpoint {root}"
                )
                faccel.shutdown(dist, trackers=[tracker] if tracker is not None else [])
                return {"stopped_at": state.step}
            if state.step >= args.max_train_steps:
                break

        eval_loss, perplexity, eval_tokens = evaluate(dist, model, eval_dataloader)
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        if tracker is not None:
            loss_sum, tokens = faccel.reduce(
                dist,
                torch.tensor(
                    [state.rank_extras["loss_sum"], state.rank_extras["tokens"]],
                    dtype=torch.float64,
                    device=dist.device,
                ),
                op="sum",
            ).tolist()
            metrics = {
                "perplexity": perplexity,
                "eval_loss": eval_loss,
                "train_loss": loss_sum / max(tokens, 1),
            }
            faccel.log(dist, tracker, state.step, {**metrics, "epoch": epoch})
        if checkpointing_steps == "epoch":  # after the epoch: a restore starts the next one
            save(attrs.evolve(state, epoch=epoch + 1, position=0, rank_extras={"loss_sum": 0.0, "tokens": 0}))

    if tracker is not None:
        faccel.end_training(dist, tracker)
    results = {
        "perplexity": perplexity,
        "eval_loss": eval_loss,
        "eval_tokens": eval_tokens,
        "step": state.step,
    }
    if args.output_dir is not None:
        faccel.save_model(dist, model, args.output_dir)  # every rank calls it; the main process writes
        if dist.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump({"perplexity": perplexity}, f)
    logger.info(f"done: {json.dumps(results)}")
    faccel.shutdown(dist)
    return {**results, "model": faccel.unwrap_model(model)}


if __name__ == "__main__":
    main(sys.argv[1:])
