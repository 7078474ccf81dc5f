"""FSDP2 checkpoints: bitwise resume on 2 ranks, and a 2-rank checkpoint into one plain process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import harness, save_model_workers, workers


def test_fsdp_resumes_bitwise_and_reshards_into_one_plain_process(tmp_path: Path) -> None:
    import faccel

    root, model_dir, boundary = tmp_path / "ckpt", tmp_path / "model", tmp_path / "boundary"
    results = harness.run(
        workers.fsdp_checkpoint,
        world_size=2,
        root=str(root),
        stop=7,
        total=12,
        model_dir=str(model_dir),
        boundary_root=str(boundary),
    )
    for r in results:
        assert r["param_types"] == ["DTensor"]
        assert r["resumed"] == r["reference"]  # bitwise: stopped at step 7 mid-epoch, resumed
        assert r["lr"] == r["reference_lr"]
    assert results[0]["stop_epoch_position"] == [1, 2]  # 40 samples / (2 x 4) = 5 batches an epoch

    # 2 ranks -> 1 process: the checkpoint restores into a plain, unsharded model.
    torch.manual_seed(5)
    plain = workers.Blocks()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    state = faccel.TrainState.create(model=plain, optimizer=optimizer, scheduler=scheduler)
    # Changed with the mid-epoch checkpoint (batch 2 of epoch 1, in batches of 2 ranks)
    # is refused in one process, untouched; the same tensors at an epoch boundary restore.
    before = [p.detach().clone() for p in plain.parameters()]
    with pytest.raises(faccel.errors.CheckpointError, match="written by 2 processes at batch 2 of epoch 1"):
        faccel.restore(faccel.detect({}), state, root)
    assert all(torch.equal(a, b) for a, b in zip(before, plain.parameters(), strict=True))
    restored = faccel.restore(faccel.detect({}), state, boundary)
    assert (restored.step, restored.epoch, restored.position) == (7, 2, 0)
    assert [p.detach().flatten().tolist() for p in plain.parameters()] == results[0]["at_stop"]
    # 0-d optimizer step tensors come back as the step count (DCP's consolidation lost them)
    steps = {s["step"].item() for s in optimizer.state.values()}
    assert steps == {7.0}
    assert optimizer.param_groups[0]["betas"] == (0.85, 0.99) and scheduler.last_epoch == 7

    # save_model wrote whole weights in the Hugging Face layout (each rank its share: an index, 2 shards)
    assert (model_dir / "model.safetensors.index.json").is_file()
    saved = save_model_workers.hf_tensors(model_dir)
    assert [saved[name].flatten().tolist() for name, _ in plain.named_parameters()] == results[0]["at_stop"]
