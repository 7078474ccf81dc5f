"""A DeepSpeed config as a value: a dict or a JSON file read into canonical JSON text.

``DistState.deepspeed`` holds the text (frozen, hashable); ``faccel._loop._strategies._deepspeed._config``
completes it with what faccel knows, and ``_engine`` beside it builds the engine. Pure: no deepspeed import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from faccel.errors import DeepSpeedConfigError

__all__ = ["read_config"]


def read_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> str:
    """Canonical JSON text of a DeepSpeed config given as a dict or as the path of a JSON file.

    Args:
        config: The config dict, or a path to its JSON file.

    Returns:
        The config as JSON text with sorted keys (what ``DistState.deepspeed`` holds).

    Raises:
        DeepSpeedConfigError: The file is missing or not a JSON object, or the
            dict holds values JSON cannot represent.

    Example:
        >>> read_config({"zero_optimization": {"stage": 2}})
        '{"zero_optimization": {"stage": 2}}'
    """
    if isinstance(config, Mapping):
        value: Any = dict(config)
        where = "the deepspeed config"
    else:
        path = Path(config)
        where = f"the deepspeed config file {str(path)!r}"
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            msg = f"{where} must be a readable JSON file, got {type(error).__name__}: {error}; fix the path"
            raise DeepSpeedConfigError(msg) from None
    if not isinstance(value, dict):
        msg = f"{where} must be a JSON object, got {type(value).__name__}"
        raise DeepSpeedConfigError(msg)
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        msg = f"{where} must hold JSON values only (numbers, strings, lists, dicts), got: {error}"
        raise DeepSpeedConfigError(msg) from None
