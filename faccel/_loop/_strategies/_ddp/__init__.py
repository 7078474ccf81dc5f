"""DDP's room: its loop strategy (``_strategy``), its communication hooks, LocalSGD (``_local_sgd``)."""
