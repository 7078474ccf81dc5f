"""FLOPs: counted by torch on one step, or the transformer formula; the device's peak to divide by.

Model FLOPs utilisation (MFU) is the FLOPs a step's model needs (not what the
hardware did: recomputation and padding do not count) divided by the time and
the device's peak. Two ways to the numerator, and the meter says which it used:

- ``"counted"``: :func:`count_flops` runs one step under torch's
  ``FlopCounterMode``, which counts the matrix products (and attention) that
  forward and backward dispatch: the number for any model, at the price of
  one step run under the counter.
- ``"formula"``: :func:`transformer_flops`, PaLM's ``6N + 12 L d s`` per token
  (N the parameters a token passes through, embeddings left out; L layers, d
  the model width, s the sequence length): no step needed, exact for a plain
  decoder (tests/test_observe.py checks it against the counter).

The peak comes from :data:`PEAK_FLOPS`, a table of known devices (dense
tensor-core figures from the vendors' data sheets, per precision), or from the
caller where the device is not in it (a CPU has no table entry: pass one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from faccel.errors import ArgumentValueError

__all__ = ["PEAK_FLOPS", "FlopSource", "count_flops", "device_peak_flops", "transformer_flops"]

FlopSource = Literal["counted", "formula", "given"]
Precision = Literal["bf16", "fp16", "fp32"]

# Dense peak FLOP/s per device, per precision ("fp32" is TF32 on the tensor cores where the device
# has them, as torch uses with allow_tf32). A device matches the first entry whose name is part of
# torch.cuda.get_device_name(); the order puts the longer names (H100 PCIe) before the shorter.
PEAK_FLOPS: tuple[tuple[str, Mapping[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 417.5e12}),
    ("H100", {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 494.7e12}),
    ("H200", {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 494.7e12}),
    ("GH200", {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 494.7e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("MI300X", {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163.4e12}),
)


def device_peak_flops(name: str, precision: Precision = "bf16") -> float | None:
    """The dense peak FLOP/s of the device called ``name`` at ``precision``; None when not in the table.

    Args:
        name: The device's name, as ``torch.cuda.get_device_name()`` says it.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (TF32 where the device has it).

    Returns:
        FLOP/s, or None for a device (or a precision of it) :data:`PEAK_FLOPS` does not hold:
        pass ``peak_flops=`` to :func:`faccel.start_meter` then.

    Example:
        >>> device_peak_flops("NVIDIA H100 80GB HBM3")
        989500000000000.0
        >>> device_peak_flops("NVIDIA H100 PCIe", "fp32")
        378000000000000.0
        >>> device_peak_flops("cpu") is None
        True
    """
    for known, peaks in PEAK_FLOPS:
        if known in name:
            return peaks.get(precision)
    return None


def transformer_flops(*, params: int, layers: int, width: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder: ``6 * params + 12 * layers * width * seq_len``.

    Forward and backward of every matrix product a token passes through (2 for
    the forward, 4 for the backward, per parameter), and the attention scores
    and their weighted sum (``QK^T`` and ``AV``, ``2 * 2 * width * seq_len`` a
    layer forward, three times that with the backward). PaLM's formula, as
    torchtitan uses it; causal masking is not subtracted.

    Args:
        params: The parameters a token passes through: the model's, less the
            embedding tables (a lookup is no product); an untied output head counts.
        layers: Transformer blocks.
        width: The model width (heads times head size).
        seq_len: Tokens a sequence.

    Returns:
        FLOPs for one token's forward and backward.

    Raises:
        ArgumentValueError: A negative count.

    Example:
        >>> transformer_flops(params=1000, layers=2, width=16, seq_len=8)
        9072.0
    """
    for what, value in (("params", params), ("layers", layers), ("width", width), ("seq_len", seq_len)):
        if value < 0:
            msg = f"transformer_flops: {what} must be >= 0, got {value}"
            raise ArgumentValueError(msg)
    return float(6 * params + 12 * layers * width * seq_len)


def count_flops(step: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``step()`` once under torch's ``FlopCounterMode``; its result and the FLOPs it dispatched.

    Run the first training step through it (forward, loss and backward; the
    optimizer's element-wise update is not counted by torch) and divide by the
    step's items for :func:`faccel.start_meter`'s ``flops_per_item``. The step
    runs as usual, only slower by the counter's bookkeeping: do it once. torch's
    counter has no formula for ``scaled_dot_product_attention``'s CPU kernel (it
    counts the CUDA ones): on a CPU, attention through SDPA counts 0, and
    :func:`transformer_flops` is the better numerator.

    Args:
        step: A callable that runs one step.

    Returns:
        ``(step's result, FLOPs)``.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(8, 4, bias=False)
        >>> _, flops = count_flops(lambda: layer(torch.ones(2, 8, requires_grad=True)).sum().backward())
        >>> flops == 6 * 8 * 4 * 2            # forward 2, backward 4, per weight per sample
        True
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        result = step()
    return result, int(counter.get_total_flops())
