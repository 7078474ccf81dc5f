"""DeepSpeed's room: its loop strategy (``_strategy``), the engine and its config (``_engine``), ZeRO's
partitions as whole tensors for checkpoints and exports (``_zero_state``)."""
