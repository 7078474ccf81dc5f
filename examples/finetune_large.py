"""Fine-tune a transformers causal LM that never is whole on one rank: built on meta, sharded, loaded by rows.

torchrun --standalone --nproc-per-node 2 examples/finetune_large.py --model_dir START --output_dir OUT
python examples/finetune_large.py --model_dir START --output_dir OUT     (one process: the same flow)

``START`` is a ``save_pretrained`` folder (``config.json`` and ``model.safetensors`` or its shards).
The flow, each step of which holds at most this rank's share of the model:

1. the memory plan first: ``faccel.estimate_memory`` (``python -m faccel plan``) prints what each
   rank will hold, from a meta build;
2. the model is built from its config under ``torch.device("meta")`` (shapes, no storage), a
   module whose buffers are computed rather than loaded (a Llama rotary table) rebuilt on the CPU,
   and the optimizer made over the meta parameters;
3. ``faccel.prepare(dist, model, optimizer, loader, init="empty")`` shards it (FSDP2 over the ranks)
   and allocates this rank's shards only; the optimizer is pointed at the sharded parameters;
4. ``faccel.load_model`` reads only this rank's rows of each tensor from ``START``;
5. a few AdamW steps on a synthetic next-token task (each sequence counts up by a fixed stride,
   so the loss falls fast), with ``faccel.checkpoint`` every ``--checkpoint_every`` steps (a
   sharded checkpoint: each rank writes its own shards) and a resume from the latest one if
   ``OUT/checkpoints`` has one;
6. ``faccel.save_model`` exports ``OUT`` in the Hugging Face layout, each rank writing its share;
   ``from_pretrained(OUT)`` loads it.

Rank 0 also writes ``OUT/logits.safetensors``: the sharded model's logits on a fixed input right
after ``load_model`` (``loaded``, to compare with ``from_pretrained(START)``'s) and after the
fine-tune (``final``, to compare with ``from_pretrained(OUT)``'s); tests/test_example_finetune_large.py
does both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import attrs
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM

import faccel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="a save_pretrained folder to start from")
    parser.add_argument("--output_dir", required=True, help="where the export (and checkpoints/) go")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all")
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq_len", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--checkpoint_every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def counting_data(vocab: int, samples: int, length: int, seed: int) -> TensorDataset:
    """Sequences ``start, start + k, start + 2k, ...`` (mod ``vocab``), ``k`` in 1..3: learnable at once."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=generator)
    stride = torch.randint(1, 4, (samples, 1), generator=generator)
    return TensorDataset((start + stride * torch.arange(length)) % vocab)


def probe(vocab: int, length: int) -> torch.Tensor:
    """The fixed input whose logits are written for comparison."""
    return (torch.arange(2 * length).view(2, length) * 7) % vocab


def computed_buffers_on_cpu(model: torch.nn.Module, config: object) -> None:
    """Rebuild, on the CPU, each module whose meta buffers are computed, never loaded (rotary tables).

    A Llama-style ``rotary_emb`` computes ``inv_freq`` in its constructor, as a
    non-persistent buffer: in no weights file, so ``load_model`` cannot fill it,
    and transformers gives the module no ``reset_parameters()`` to recompute it,
    so ``prepare(init="empty")`` refuses it by name. Such a module holds a few
    numbers: built again outside meta from the config, it keeps its values
    through ``prepare`` (docs/large-models.md). GPT-2 has none.
    """
    for path, module in list(model.named_modules()):
        owns_meta_buffers = any(buffer.is_meta for buffer in module.buffers(recurse=False))
        if path and owns_meta_buffers and not hasattr(module, "reset_parameters"):
            with torch.device("cpu"):
                rebuilt = type(module)(config=config)
            parent, _, name = path.rpartition(".")
            model.get_submodule(parent).register_module(name, rebuilt)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    dist = faccel.detect(strategy="fsdp", seed=args.seed)
    out = Path(args.output_dir)
    config = AutoConfig.from_pretrained(args.model_dir)

    def build() -> torch.nn.Module:
        return AutoModelForCausalLM.from_config(config)

    ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
    plan = faccel.estimate_memory(build, dist.world_size, ["fsdp"], inputs={"input_ids": ids, "labels": ids})
    faccel.print(dist, plan)

    with torch.device("meta"):  # shapes only: no rank ever holds the whole model
        model = build()
    computed_buffers_on_cpu(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    data = counting_data(config.vocab_size, 64 * dist.world_size, args.seq_len, args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader, init="empty")
    faccel.load_model(dist, model, args.model_dir)  # each rank reads only its own rows
    with torch.no_grad():  # every rank runs the forward: a sharded model gathers from all of them
        loaded = model.eval()(input_ids=probe(config.vocab_size, args.seq_len)).logits

    root = out / "checkpoints"
    state = faccel.TrainState.create(model=model, optimizer=optimizer, loader=loader)
    if faccel.latest_checkpoint(root) is not None:
        state = faccel.restore(dist, state, root)
        faccel.print(dist, f"resumed from step {state.step}")
    steps_per_epoch = len(loader)
    model.train()
    loss_value = float("nan")
    while state.step < args.steps:
        epoch, batch_index = divmod(state.step, steps_per_epoch)
        for (batch,) in loader.at(epoch=epoch, start=batch_index):
            loss = model(input_ids=batch, labels=batch).loss
            faccel.backward(dist, loss)
            optimizer.step()
            optimizer.zero_grad()
            loss_value = float(faccel.reduce(dist, loss.detach(), op="mean"))
            step = state.step + 1
            state = attrs.evolve(
                state, step=step, epoch=step // steps_per_epoch, position=step % steps_per_epoch
            )
            faccel.print(dist, f"step {step}: loss {loss_value:.4f}")
            if step % args.checkpoint_every == 0 or step == args.steps:
                faccel.checkpoint(dist, state, root, keep=2)
            if step == args.steps:
                break

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe(config.vocab_size, args.seq_len)).logits
    faccel.save_model(dist, model, out)  # each rank writes its share; one commit
    if dist.is_main_process:
        from safetensors.torch import save_file

        save_file(
            {"loaded": loaded.contiguous(), "final": logits.contiguous()}, str(out / "logits.safetensors")
        )
    results = {"step": state.step, "loss": loss_value}
    faccel.print(dist, "done: " + json.dumps(results))
    faccel.shutdown(dist)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
