"""DeepSpeed's room: its loop strategy (``_strategy``), the config faccel completes
(``_config``, pure) and the engine built from it (``_engine``).

ZeRO's partitions as whole tensors for checkpoints and exports are the checkpoint seam's room:
``faccel._checkpoint._strategies._zero`` and ``_zero_state``.
"""
