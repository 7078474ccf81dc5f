"""The DeviceMesh's room: its loop strategy (``_strategy``), the tensor-parallel plan (``_tp_plan``)."""
