"""DeepSpeed's room: the engine and its config (``_engine``), ZeRO's partitions whole (``_zero_state``)."""
