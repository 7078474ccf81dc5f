"""See the run: items/s, MFU, peak memory and step time each step; stragglers; hangs; the pictures.

python examples/observe.py RUN_DIR
torchrun --standalone --nproc-per-node 2 examples/observe.py RUN_DIR [--slow-rank 1]

A small decoder trains on random tokens. Each step adds one call, ``faccel.measure``; every 10
steps ``faccel.check_stragglers`` compares the ranks (one small collective) and names any rank
slower than twice the median (``--slow-rank R`` makes rank R sleep in its forward, to see it
named). The meter's fields go to the tracker under their standard names; RUN_DIR/hangs holds
each rank's hang record. At the end, the main process draws RUN_DIR/metrics.png (with
matplotlib) and RUN_DIR/metrics.html, as ``python -m faccel plot RUN_DIR`` does.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import faccel

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 2, 32, 8


class Decoder(nn.Module):
    """Embedding, pre-norm transformer blocks, an untied head: what the 6N + attention formula counts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # The mask made here, not kept as a buffer: DDP broadcasts buffers at every forward, and the
        # fast ranks would wait for a slow one there, inside the time check_stragglers compares.
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.blocks(self.embed(tokens), mask=causal, is_causal=True))


def main(run_dir: str, steps: int = 40, slow_rank: int | None = None) -> None:
    dist = faccel.detect()
    torch.manual_seed(0)
    model = Decoder()
    # N for the formula: the parameters a token passes through (not the embedding table).
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed."))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    tracker = faccel.init_tracker(dist, run_dir, config={"params": params, "seq_len": SEQ})
    tokens_per_step = BATCH * SEQ
    flops = faccel.transformer_flops(params=params, layers=LAYERS, width=WIDTH, seq_len=SEQ)
    # On a GPU the peak comes from faccel's table; on a CPU give one (here: 100 GFLOP/s a core).
    peak = None if dist.device.type == "cuda" else 100e9
    meter = faccel.start_meter(dist, flops_per_item=flops, flops_source="formula", peak_flops=peak)
    generator = torch.Generator().manual_seed(dist.rank)
    slow_by = 0.0  # --slow-rank's delay: 4 of its forwards, as measured in the first step
    for step in faccel.progress(dist, range(steps), items_per_batch=tokens_per_step, desc="tokens"):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator).to(dist.device)
        if dist.rank == slow_rank:
            time.sleep(slow_by)  # a slow data loader, say: this rank's forward starts late
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        faccel.backward(dist, loss)
        optimizer.step()
        optimizer.zero_grad()
        meter = faccel.measure(dist, meter, items=tokens_per_step)  # the one call a step
        if step == 0:
            slow_by = 4 * (meter.forward_seconds or meter.step_seconds)
        spread, meter = faccel.check_stragglers(dist, meter, every=10, factor=2.0)
        faccel.log(dist, tracker, step, {"loss": loss.detach(), **meter.metrics()})
        if spread is not None:
            faccel.log(dist, tracker, step, spread.metrics())
            if spread.stragglers:
                faccel.print(dist, spread.describe())
    spec = meter.spec
    faccel.print(
        dist,
        f"{meter.run_items_per_second:.0f} tokens/s a rank, MFU {meter.mfu:.2%} of {spec.peak_flops:.3g} "
        f"FLOP/s ({spec.flops_source}), peak memory {meter.memory_bytes / 2**20:.0f} MiB",
    )
    faccel.shutdown(dist, trackers=[tracker])
    if dist.is_main_process:
        from faccel._report._metrics_file import plot

        print(f"wrote {plot(run_dir, f'{run_dir}/metrics.html')}")
        try:
            print(f"wrote {plot(run_dir)}")
        except ImportError:
            print("matplotlib is not installed: no metrics.png")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow-rank", type=int, default=None)
    args = parser.parse_args()
    main(args.run_dir, steps=args.steps, slow_rank=args.slow_rank)
