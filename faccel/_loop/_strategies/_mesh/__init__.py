"""The DeviceMesh's room (tensor parallelism, HSDP): the user's tensor-parallel plan (``_tp_plan``)."""
