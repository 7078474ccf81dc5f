"""A root as the user gives it (a path, or a URL) to a :class:`~faccel._storage._store.Spot` of its store.

A path, or a ``file://`` URL, is the local disk (``_local``). Any other URL
(``s3://bucket/run``, ``gs://bucket/run``, ``memory://run``) is object storage
through fsspec (``_objects``), imported only then: without the optional extra
that provides its protocol, the URL is refused by name, with the extra to
install, before anything is written.

A root is parsed here once, strictly (:func:`parse_root`), so that a typing
slip never becomes a local folder: a path whose first name has a ``:`` (``s3:/b/run``,
``s3:b/run``, ``s3 ://b/run``), a root with a space at either end, a chained
fsspec URL (``simplecache::s3://...``: its cache would write to a local folder and
never to the bucket), credentials in a URL (never echoed), an empty name between two
slashes (``s3://bucket//run``), a query or fragment (``?versionId=...``) are refused
by name with :class:`~faccel.errors.ArgumentValueError`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from faccel._storage._local import local_spot
from faccel._storage._store import Spot

__all__ = ["is_url", "parse_root", "refuse_url", "shown", "spot_of"]

_URL = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")
# A first name that ends in ':' after a word: a URL typed wrong (s3:/b, s3:b, "s3 ://b").
_LIKE_URL = re.compile(r"\s*[a-zA-Z][a-zA-Z0-9+. -]*:")
# ``user:secret@`` or ``user@`` before the first '/' of what follows ``://``.
_CREDENTIALS = re.compile(r"[^/]*@")


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
        ArgumentValueError: ``path`` is a URL of object storage, or not a valid root (:func:`parse_root`).

    Example:
        >>> refuse_url("runs/a", what="convert's source")
        >>> refuse_url("s3://bucket/model", what="convert's source")
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: convert's source is a URL (s3://...); it takes a local ...
    """
    if path is None:
        return
    parse_root(path)  # a mistyped URL is refused as such, not taken for a local folder
    if not is_url(path):
        return
    from faccel.errors import ArgumentValueError

    protocol = os.fspath(path).split("://", 1)[0]
    msg = (
        f"{what} is a URL ({protocol}://...); it takes a local folder only: copy the files down first "
        f"(aws s3 cp --recursive, gsutil -m cp -r, or fsspec's get), run it on the copy, and copy the "
        "result up (docs/object-storage.md)"
    )
    raise ArgumentValueError(msg)


def _refuse(text: str, why: str, instead: str) -> None:
    from faccel.errors import ArgumentValueError

    msg = f"{text!r} is not a root faccel takes: {why}; {instead} (docs/object-storage.md)"
    raise ArgumentValueError(msg)


def parse_root(path: str | os.PathLike[str]) -> str:
    """``path`` checked as a root: a local path, or a URL ``protocol://bucket/key`` (returned as text).

    Raises:
        ArgumentValueError: What looks like a URL but is not a valid one, a chained URL,
            credentials in a URL (not echoed), an empty name between slashes, a query.

    Example:
        >>> parse_root("runs/a"), parse_root("s3://bucket/run/")
        ('runs/a', 's3://bucket/run/')
        >>> parse_root("s3:/bucket/run")
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: 's3:/bucket/run' is not a root faccel takes: ...
    """
    text = os.fspath(path)
    if text != text.strip():
        _refuse(text, "it begins or ends with a space", "remove the space")
    if "::" in text:
        head = text.split("::", 1)[0]
        _refuse(
            f"{head}::...",
            "a chained fsspec URL (its first layer, a cache or a wrapper, would write to a local "
            "folder or elsewhere, not to the store)",
            "give the store's own URL (s3://bucket/run): faccel writes to it directly and reads "
            "by byte ranges, with no cache to fill",
        )
    match = _URL.match(text)
    if match is None:
        if _LIKE_URL.match(text):
            _refuse(
                text,
                "its first name has a ':', as a mistyped URL has (a URL is PROTOCOL://BUCKET/KEY)",
                f"write the URL with '://' (s3://bucket/run), or a local folder so named as './{text}'",
            )
        return text
    rest = text[match.end() :]
    if _CREDENTIALS.match(rest):
        _refuse(
            f"{match.group(0)}***@{rest.split('@', 1)[1]}",
            "a URL with credentials in it (they would show in logs and errors)",
            "set them in the standard environment variables or fsspec's configuration",
        )
    if match.group(1).lower() == "file":
        return text
    if "?" in rest or "#" in rest:
        _refuse(
            text,
            "a URL with a query or a fragment ('?' or '#': a version, an option)",
            "give the bucket and key only; options go in fsspec's configuration",
        )
    # (One leading '/' is fsspec's memory:// spelling: memory:///run is memory://run.)
    keys = rest[1:] if rest.startswith("/") else rest
    if "//" in keys.rstrip("/") or keys.startswith("/") or not keys.strip("/"):
        _refuse(
            text,
            "an empty name between two slashes, or no bucket (a store keeps such keys apart from "
            "the ones without it)",
            "write each name once: protocol://bucket/run",
        )
    return text


def spot_of(path: str | os.PathLike[str] | Spot) -> Spot:
    """The store and key of ``path``: the local disk for a path, fsspec's for a URL.

    Raises:
        MissingExtraError: A URL whose protocol's package (the extra) is not installed.
        ArgumentValueError: Not a valid root (:func:`parse_root`).

    Example:
        >>> str(spot_of("runs/a")), spot_of("file:///tmp/a").key
        ('runs/a', '/tmp/a')
    """
    if isinstance(path, Spot):
        return path
    text = parse_root(path)
    if not is_url(text):
        return local_spot(text[len("file://") :] if text.lower().startswith("file://") else text)
    from faccel._storage._objects import object_spot

    return object_spot(text)


def shown(spot: Spot) -> Path | str:
    """What a public function returns for ``spot``: a :class:`pathlib.Path` on the disk, else its URL."""
    return Path(spot.key) if spot.store.local else str(spot)
