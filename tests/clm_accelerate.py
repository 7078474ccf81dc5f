"""The training loop of transformers' ``run_clm_no_trainer.py`` under Accelerate, for comparison.

python tests/clm_accelerate.py ARGS  (the arguments of examples/run_clm.py)

The loop is the Accelerate script's (``Accelerator``, ``set_seed``, ``accelerator.prepare``,
``accelerator.accumulate``, ``accelerator.backward(outputs.loss)``, a scheduler sized and stepped the
Accelerate way, ``gather_for_metrics(loss.repeat(...))``, ``save_pretrained``), with its seedable
sampler on (``use_seedable_sampler=True``: the shuffle is drawn from ``seed + epoch``, as a prepared
faccel loader's is). The data (the text file, the tokeniser, ``group_texts``) and the model come from
the faccel example's own functions, so that only the loops differ. Used by
tests/test_example_run_clm.py; needs accelerate (not in the test extra).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "run_clm.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("run_clm_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    # Imported here: pytest's --doctest-modules imports this file, where accelerate may be missing.
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import default_data_collator, get_scheduler

    clm = _example()
    args = clm.parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        cpu=True,
    )
    if args.seed is not None:
        set_seed(args.seed)

    raw = clm.load_texts(args)
    with accelerator.main_process_first():
        tokenizer, model = clm.build_tokenizer_and_model(args)
        block_size = clm.block_size_of(args, tokenizer)
        train_dataset = clm.lm_dataset(raw["train"], tokenizer, block_size)
        eval_dataset = clm.lm_dataset(raw["validation"], tokenizer, block_size)

    train_dataloader = DataLoader(
        train_dataset,
        shuffle=True,
        collate_fn=default_data_collator,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )
    optimizer = torch.optim.AdamW(clm.optimizer_groups(model, args.weight_decay), lr=args.learning_rate)

    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps
        if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    completed_steps = 0
    perplexity = float("nan")
    for epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            batch_size = batch["input_ids"].shape[0]
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch_size)))
        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        print(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({"perplexity": perplexity, "step": completed_steps}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
