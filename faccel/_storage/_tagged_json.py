"""Tagged JSON: the Python values a checkpoint holds, written without pickle.

Plain JSON cannot say "tuple", "dict with int keys", "NaN" or "tensor", yet
optimizer and scheduler states need all four (Adam's ``betas`` is a tuple,
optimizer state is keyed by int, ``ReduceLROnPlateau.best`` starts at inf).
Each such value becomes a one-key JSON object whose key is a tag:

==================== =========================================================
``{"__tuple__": [...]}``            a tuple of the encoded items
``{"__dict__": [[k, v], ...]}``     a dict whose keys are not all strings, or
                                    a one-key dict whose key looks like a tag
``{"__float__": "nan"}``            ``nan``, ``inf`` or ``-inf`` (a NaN of another
                                    sign or payload: ``"nan:<16 hex digits>"``,
                                    its bits, big-endian)
``{"__bytes__": "<base64>"}``       bytes
``{"__ndarray__": {...}}``          a NumPy array or scalar: ``dtype`` (e.g.
                                    ``"<u4"``), ``shape`` (null for a scalar),
                                    ``data`` (base64 of its bytes)
``{"__tensor__": [file, key]}``     a tensor stored under ``key`` in the
                                    safetensors file ``file``
``{"__inline_tensor__": {...}}``    a small tensor in the JSON itself:
                                    ``dtype`` (a safetensors dtype code),
                                    ``shape``, ``data`` (base64)
==================== =========================================================

Everything else is JSON as it is: ``null``, booleans, integers, finite floats
(Python writes the shortest text that reads back to the same bits), strings,
lists, and objects with string keys. Decoding builds only these types, so a
file can never make faccel run code.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from faccel._storage._safetensors import DTYPE_CODES, dtype_of_code, valid_shape
from faccel._torch_compat import is_dtensor
from faccel.errors import CheckpointError

__all__ = [
    "TensorSink",
    "decode",
    "encode",
    "tensor_refs",
]

_TAGS = frozenset(
    {"__tuple__", "__dict__", "__float__", "__bytes__", "__ndarray__", "__tensor__", "__inline_tensor__"}
)

# NumPy dtype kinds that hold plain numbers (never "O": object arrays would need pickle).
_NUMPY_KINDS = frozenset("biufc")


@attrs.define(kw_only=True)
class TensorSink:
    """Collects the tensors met while encoding, for one safetensors file.

    ``tensors`` maps a unique key (built from the value's path) to the tensor;
    the JSON keeps ``{"__tensor__": [file, key]}`` in its place.
    """

    file: str
    tensors: dict[str, torch.Tensor] = attrs.field(factory=dict)
    # The sharded format's sinks take DTensors: each rank writes its own rows of them.
    shards: bool = False

    def add(self, path: str, tensor: torch.Tensor) -> str:
        key = path or "tensor"
        if key in self.tensors:
            n = 1
            while f"{key}#{n}" in self.tensors:
                n += 1
            key = f"{key}#{n}"
        self.tensors[key] = tensor
        return key


def _b64(data: bytes | memoryview) -> str:
    return base64.b64encode(data).decode("ascii")


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _join(path: str, part: object) -> str:
    return f"{path}.{part}" if path else str(part)


_CANONICAL_NAN = struct.pack("<d", math.nan)


def _non_finite(value: float) -> str:
    if not math.isnan(value):
        return repr(value)  # 'inf' or '-inf'
    bits = struct.pack("<d", value)
    # Any NaN other than the usual one keeps its sign and payload: bitwise exact.
    return "nan" if bits == _CANONICAL_NAN else f"nan:{bits[::-1].hex()}"


def _float_of(text: str) -> float | None:
    if text in ("nan", "inf", "-inf"):
        return float(text)
    if text.startswith("nan:") and len(text) == 20:
        try:
            value: float = struct.unpack("<d", bytes.fromhex(text[4:])[::-1])[0]
        except ValueError:
            return None
        return value if math.isnan(value) else None
    return None


def encode(value: Any, *, sink: TensorSink | None = None, path: str = "") -> Any:
    """``value`` as tagged JSON; tensors go to ``sink``, or inline when it is None.

    Raises :class:`CheckpointError` naming the path of a value that has no
    pickle-free form (a function, a custom object...).

    Example:
        >>> encode({"betas": (0.9, 0.999), 3: float("inf")})
        {'__dict__': [['betas', {'__tuple__': [0.9, 0.999]}], [3, {'__float__': 'inf'}]]}
    """
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"__float__": _non_finite(value)}
    if isinstance(value, np.ndarray | np.generic):
        return _encode_numpy(value, path)
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, sink, path)
    if isinstance(value, dict):
        keys = list(value)
        if all(type(key) is str for key in keys) and not (len(keys) == 1 and keys[0] in _TAGS):
            return {key: encode(item, sink=sink, path=_join(path, key)) for key, item in value.items()}
        return {
            "__dict__": [
                [encode(key, path=_join(path, "<key>")), encode(item, sink=sink, path=_join(path, key))]
                for key, item in value.items()
            ]
        }
    if kind is list:
        return [encode(item, sink=sink, path=_join(path, i)) for i, item in enumerate(value)]
    if kind is tuple or kind is torch.Size:
        return {"__tuple__": [encode(item, sink=sink, path=_join(path, i)) for i, item in enumerate(value)]}
    if kind is bytes:
        return {"__bytes__": _b64(value)}
    msg = (
        f"{path or 'the value'} is a {kind.__module__}.{kind.__qualname__}, which a checkpoint "
        "cannot store without pickle; store JSON values (None, bool, int, float, str, list, tuple, "
        "dict), bytes, NumPy arrays or tensors, or an object with state_dict()/load_state_dict()"
    )
    raise CheckpointError(msg)


def _encode_numpy(value: np.ndarray | np.generic, path: str) -> dict[str, Any]:
    array = np.asarray(value)
    if array.dtype.kind not in _NUMPY_KINDS:
        msg = f"{path or 'the value'} is a NumPy array of dtype {array.dtype}, which needs pickle"
        raise CheckpointError(msg)
    shape = None if isinstance(value, np.generic) else list(array.shape)
    data = np.ascontiguousarray(array).tobytes()
    return {"__ndarray__": {"dtype": array.dtype.str, "shape": shape, "data": _b64(data)}}


def _encode_tensor(value: torch.Tensor, sink: TensorSink | None, path: str) -> dict[str, Any]:
    if is_dtensor(value) and not (sink is not None and sink.shards):
        # A sharded (FSDP2/TP) tensor holds only this rank's piece: saving it as a
        # whole tensor would be wrong, so refuse rather than write a partial state.
        msg = f"{path or 'the value'} is a DTensor (sharded); faccel checkpoints hold whole tensors"
        raise CheckpointError(msg)
    if value.dtype not in DTYPE_CODES:
        msg = f"{path or 'the value'} is a tensor of dtype {value.dtype}, which safetensors cannot store"
        raise CheckpointError(msg)
    if sink is not None:
        return {"__tensor__": [sink.file, sink.add(path, value)]}
    return {
        "__inline_tensor__": {
            "dtype": DTYPE_CODES[value.dtype],
            "shape": list(value.shape),
            "data": _b64(_tensor_bytes(value)),
        }
    }


def tensor_refs(tree: Any) -> Iterator[tuple[str, str]]:
    """Every ``(file, key)`` that an encoded tree refers to."""
    if isinstance(tree, list):
        for item in tree:
            yield from tensor_refs(item)
    elif isinstance(tree, dict):
        if len(tree) == 1 and "__tensor__" in tree:
            ref = tree["__tensor__"]
            if isinstance(ref, list) and len(ref) == 2 and all(isinstance(r, str) for r in ref):
                yield ref[0], ref[1]
            return
        for item in tree.values():
            yield from tensor_refs(item)


def decode(tree: Any, *, tensors: Mapping[str, Mapping[str, torch.Tensor]], where: str) -> Any:
    """The value that :func:`encode` wrote; tensors looked up in ``tensors[file][key]``.

    ``where`` names the file for error messages. Raises :class:`CheckpointError`
    on anything :func:`encode` cannot have written.

    Example:
        >>> decode({"__tuple__": [0.9, {"__float__": "nan"}]}, tensors={}, where="state.json")
        (0.9, nan)
    """
    return _decode(tree, tensors, where, "")


def _bad(where: str, path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {path or 'the top-level value'}: {what}")


def _decode(tree: Any, tensors: Mapping[str, Mapping[str, torch.Tensor]], where: str, path: str) -> Any:
    kind = type(tree)
    if tree is None or kind is bool or kind is int or kind is str:
        return tree
    if kind is float:
        return tree
    if kind is list:
        return [_decode(item, tensors, where, _join(path, i)) for i, item in enumerate(tree)]
    if kind is not dict:
        raise _bad(where, path, f"unexpected JSON value of type {kind.__name__}")
    if len(tree) == 1:
        ((tag, body),) = tree.items()
        if tag in _TAGS:
            return _decode_tagged(tag, body, tensors, where, path)
    return {key: _decode(item, tensors, where, _join(path, key)) for key, item in tree.items()}


def _decode_tagged(
    tag: str, body: Any, tensors: Mapping[str, Mapping[str, torch.Tensor]], where: str, path: str
) -> Any:
    if tag == "__tuple__" and type(body) is list:
        return tuple(_decode(item, tensors, where, _join(path, i)) for i, item in enumerate(body))
    if tag == "__dict__" and type(body) is list:
        out: dict[Any, Any] = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise _bad(where, path, "a __dict__ entry is not a [key, value] pair")
            key = _decode(pair[0], tensors, where, _join(path, "<key>"))
            try:
                out[key] = _decode(pair[1], tensors, where, _join(path, key))
            except TypeError:  # an unhashable key, e.g. a list
                raise _bad(where, path, f"unhashable dict key {key!r}") from None
        return out
    if tag == "__float__" and type(body) is str and (number := _float_of(body)) is not None:
        return number
    if tag == "__bytes__" and type(body) is str:
        return _unb64(body, where, path)
    if tag == "__ndarray__" and type(body) is dict:
        return _decode_numpy(body, where, path)
    if tag == "__tensor__" and type(body) is list and len(body) == 2 and all(type(p) is str for p in body):
        file, key = body
        found = tensors.get(file, {}).get(key)
        if found is not None:
            return found
        raise _bad(where, path, f"refers to tensor {key!r} of {file}, which that file does not hold")
    if tag == "__inline_tensor__" and type(body) is dict:
        return _decode_inline_tensor(body, where, path)
    raise _bad(where, path, f"malformed {tag} value {body!r:.80}")


def _unb64(text: str, where: str, path: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise _bad(where, path, "invalid base64 data") from None


def _shape(value: Any, where: str, path: str) -> tuple[int, ...]:
    shape = valid_shape(value)
    if shape is None:
        raise _bad(where, path, f"shape must be a list of non-negative integers, got {value!r:.80}")
    return shape


def _decode_numpy(body: dict[str, Any], where: str, path: str) -> np.ndarray | np.generic:
    if set(body) != {"dtype", "shape", "data"} or type(body["dtype"]) is not str:
        raise _bad(where, path, "an __ndarray__ needs exactly dtype, shape and data")
    try:
        dtype = np.dtype(body["dtype"])
    except (TypeError, ValueError, OverflowError):
        raise _bad(where, path, f"unknown NumPy dtype {body['dtype']!r:.80}") from None
    if dtype.kind not in _NUMPY_KINDS or dtype.shape or dtype.fields is not None:
        raise _bad(where, path, f"NumPy dtype {dtype} is not a plain number type")
    data = _unb64(body["data"], where, path) if type(body["data"]) is str else None
    shape = None if body["shape"] is None else _shape(body["shape"], where, path)
    count = 1 if shape is None else math.prod(shape)
    if data is None or len(data) != count * dtype.itemsize:
        raise _bad(where, path, f"__ndarray__ data does not hold {count} values of {dtype}")
    array = np.frombuffer(data, dtype=dtype, count=count).copy()
    return array[0] if shape is None else array.reshape(shape)


def _decode_inline_tensor(body: dict[str, Any], where: str, path: str) -> torch.Tensor:
    if set(body) != {"dtype", "shape", "data"} or type(body["data"]) is not str:
        raise _bad(where, path, "an __inline_tensor__ needs exactly dtype, shape and data")
    dtype = dtype_of_code(body["dtype"], f"{where}: {path}")
    shape = _shape(body["shape"], where, path)
    data = _unb64(body["data"], where, path)
    itemsize = dtype.itemsize
    if len(data) != math.prod(shape) * itemsize:
        raise _bad(where, path, f"__inline_tensor__ data does not match shape {list(shape)} of {dtype}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
