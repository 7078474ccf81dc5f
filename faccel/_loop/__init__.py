"""The training loop: prepare, model wrapping, precision, backward, accumulation, clipping."""
