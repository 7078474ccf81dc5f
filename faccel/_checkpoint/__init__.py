"""Checkpoints: a TrainState to a folder of safetensors and JSON, atomically, and back.

The modules, from the flow down to the bytes:

- ``_orchestrate``: :func:`checkpoint` and :func:`restore` across ranks.
- ``_folders``: the root folder: the latest complete checkpoint, rotation, leftovers.
- ``_format``: every file name, folder pattern and format version.
- ``_capture``: live objects to what is written (``state.json`` content, tensors, generators).
- ``_verify``: every check, made before anything is loaded.
- ``_load``: checked content into the live objects.
- ``_weights``: a model's tensors, tied weights stored once, compared on load.
- ``_sharded_state``: FSDP2 state dicts: each rank's shards, or whole ones gathered and scattered.
- ``_background``: ``checkpoint(..., blocking=False)``: the write and commit on a thread.
- ``_sharded_files``, ``_layout``, ``_shards``: the sharded format (version 2): what each rank
  writes, the chunk rule, and a rank's shard file with a checksum per hash block.
- ``_tagged_json``: the Python values of ``state.json``, as JSON without pickle.
- ``_safetensors``: the safetensors format and its dtype table.
- ``_durable``: files written, hashed and fsynced; read back and checked.

The Hugging Face weights export (``faccel._save_model``) uses the lower
modules (``_weights``, ``_safetensors``, ``_durable``); nothing here imports it.
"""

from faccel._checkpoint._background import free_memory
from faccel._checkpoint._orchestrate import checkpoint, latest_checkpoint, restore

__all__ = ["checkpoint", "free_memory", "latest_checkpoint", "restore"]
