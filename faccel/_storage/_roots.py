"""A root as the user gives it (a path, or a URL) to a :class:`~faccel._storage._store.Spot` of its store.

A path, or a ``file://`` URL, is the local disk (``_local``). Any other URL
(``s3://bucket/run``, ``gs://bucket/run``, ``memory://run``) is object storage
through fsspec (``_objects``), imported only then: without the optional extra
that provides its protocol, the URL is refused by name, with the extra to
install, before anything is written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from faccel._storage._local import local_spot
from faccel._storage._store import Spot

__all__ = ["is_url", "refuse_url", "shown", "spot_of"]

_URL = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_url(path: str | os.PathLike[str] | Spot) -> bool:
    """Whether ``path`` names object storage (a URL other than ``file://``).

    Example:
        >>> is_url("s3://bucket/run"), is_url("runs/a"), is_url("file:///tmp/a")
        (True, False, False)
    """
    if isinstance(path, Spot):
        return not path.store.local
    match = _URL.match(os.fspath(path))
    return match is not None and match.group(1).lower() != "file"


def refuse_url(path: str | os.PathLike[str] | None, *, what: str) -> None:
    """Refuse a URL where only a local path is taken (``what``: the function and the argument), by
    name and with what to do instead; a local path (or None) passes.

    Raises:
        ArgumentValueError: ``path`` is a URL of object storage.

    Example:
        >>> refuse_url("runs/a", what="convert's source")
        >>> refuse_url("s3://bucket/model", what="convert's source")
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: convert's source is a URL (s3://...); it takes a local ...
    """
    if path is None or not is_url(path):
        return
    from faccel.errors import ArgumentValueError

    protocol = os.fspath(path).split("://", 1)[0]
    msg = (
        f"{what} is a URL ({protocol}://...); it takes a local folder only: copy the files down first "
        f"(aws s3 cp --recursive, gsutil -m cp -r, or fsspec's get), run it on the copy, and copy the "
        "result up (docs/object-storage.md)"
    )
    raise ArgumentValueError(msg)


def spot_of(path: str | os.PathLike[str] | Spot) -> Spot:
    """The store and key of ``path``: the local disk for a path, fsspec's for a URL.

    Raises:
        MissingExtraError: A URL whose protocol's package (the extra) is not installed.

    Example:
        >>> str(spot_of("runs/a")), spot_of("file:///tmp/a").key
        ('runs/a', '/tmp/a')
    """
    if isinstance(path, Spot):
        return path
    text = os.fspath(path)
    if not is_url(text):
        return local_spot(text[len("file://") :] if text.lower().startswith("file://") else text)
    from faccel._storage._objects import object_spot

    return object_spot(text)


def shown(spot: Spot) -> Path | str:
    """What a public function returns for ``spot``: a :class:`pathlib.Path` on the disk, else its URL."""
    return Path(spot.key) if spot.store.local else str(spot)
