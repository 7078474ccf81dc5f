"""The sharded checkpoint format: chunk rule, shard files, rank pages, FSDP2 state."""
