"""DeepSpeed's room: its loop strategy (``_strategy``), the engine and its config (``_engine``).

ZeRO's partitions as whole tensors for checkpoints and exports are the checkpoint seam's room:
``faccel._checkpoint._strategies._zero`` and ``_zero_state``.
"""
