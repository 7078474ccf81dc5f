"""Checkpoints: a TrainState to a folder of safetensors and JSON, atomically, and back.

The modules, from the flow down (README.md beside this file reads them in the
order a checkpoint flows through them):

- ``_save``: :func:`checkpoint` across ranks: prepare, write, commit.
- ``_restore``: :func:`restore`: find, read, verify, load.
- ``_folders``: the root folder: the latest complete checkpoint, rotation, leftovers.
- ``_format``: every file name, folder pattern and format version.
- ``_capture``: live objects to what is written (``state.json`` content, tensors, generators).
- ``_verify``: every check, made before anything is loaded.
- ``_stage``: each ``load_state_dict`` tried first on a data-less copy.
- ``_load``: checked content into the live objects.
- ``_background``: ``checkpoint(..., blocking=False)``: the write and commit on a thread.
- ``_sharded/``: the sharded format (version 2): the chunk rule, shard files, rank pages, FSDP2 state.

Bytes and formats with no notion of training (durable files, safetensors,
tagged JSON, a model's tensors) are in ``faccel/_storage/``; the Hugging Face
layout (``faccel/_hf/``) builds on this package, never the reverse.
"""

from faccel._checkpoint._background import free_memory
from faccel._checkpoint._restore import latest_checkpoint, restore
from faccel._checkpoint._save import checkpoint

__all__ = ["checkpoint", "free_memory", "latest_checkpoint", "restore"]
