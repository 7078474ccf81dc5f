"""Bytes on disk: durable files, safetensors, tagged JSON, a model's tensors, legacy .bin."""
