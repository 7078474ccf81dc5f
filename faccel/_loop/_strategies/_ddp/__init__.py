"""DDP's room: its communication hooks (``_comm_hooks``) and LocalSGD (``_local_sgd``)."""
