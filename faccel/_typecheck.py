"""Runtime type checks for set-up functions, paid for on first call, not at import.

``typeguard.typechecked`` recompiles a function's source, which costs
milliseconds per function; done at import it would make ``import faccel``
slow. Here the first call instruments the function and keeps the result on
the wrapper. The per-step path (backward, loader iteration) is never checked.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Generator, Mapping
from typing import Any, TypeVar

from faccel._choices import CLOSED_SETS, ClosedSet
from faccel.errors import ArgumentError

F = TypeVar("F", bound=Callable[..., Any])


class Settings:
    """What set-up functions take first: ``DistState`` derives from it.

    A layer below ``_dist``, the type check cannot import ``DistState``; it asks
    ``isinstance(first, Settings)`` instead of comparing class names.
    """

    __slots__ = ()


_MISSING = object()  # an immutable sentinel: no dist given at all


def setup_checked(fn: F) -> F:
    """Check the arguments and return value of ``fn`` against its annotations."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        checked = wrapper.__dict__.get("_checked")
        if checked is None:
            from typeguard import typechecked

            checked = typechecked(fn)
            wrapper.__dict__["_checked"] = checked
        from typeguard import TypeCheckError

        closed = wrapper.__dict__.get("_closed")
        if closed is None:
            closed = wrapper.__dict__["_closed"] = _closed_parameters(fn)
        if closed:
            _check_words(fn, closed, args, kwargs)

        # dist may come by position or by keyword (init_tracker(dist=dist, ...)).
        first = args[0] if args else kwargs.get("dist", _MISSING)
        if takes_dist and not isinstance(first, Settings):
            # The usual slip of an Accelerate user: the state left out of the call, which
            # would otherwise surface as a missing argument or a type error further on.
            given = "nothing" if first is _MISSING else type(first).__name__
            msg = (
                f"{fn.__qualname__}() takes the DistState first, got {given}; "
                f"call it as faccel.{fn.__name__}(dist, ...) with dist = faccel.detect()"
            )
            raise ArgumentError(msg)
        try:
            result = checked(*args, **kwargs)
        except TypeCheckError as error:
            msg = f"{fn.__qualname__}(): {error}"
            raise ArgumentError(msg) from None
        # A generator (a context manager's body) checks its arguments when first advanced, inside
        # ``__enter__``: its type errors are named there too.
        return _named_type_errors(fn, result) if is_generator else result

    takes_dist = fn.__code__.co_varnames[:1] == ("dist",)
    is_generator = inspect.isgeneratorfunction(fn)

    return wrapper  # type: ignore[return-value]


def _named_type_errors(
    fn: Callable[..., Any], generator: Generator[Any, Any, Any]
) -> Generator[Any, Any, Any]:
    """``generator``'s items; typeguard's ``TypeCheckError`` of its arguments (raised before its first
    item) as an :class:`ArgumentError`. What the caller's block raises later is thrown in unchanged."""
    from typeguard import TypeCheckError

    try:
        item = next(generator)
    except TypeCheckError as error:
        msg = f"{fn.__qualname__}(): {error}"
        raise ArgumentError(msg) from None
    except StopIteration as stop:
        return stop.value
    while True:  # ``yield from``, less the first item
        try:
            sent = yield item
        except GeneratorExit:
            generator.close()
            raise
        except BaseException as error:
            try:
                item = generator.throw(error)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                item = generator.send(sent)
            except StopIteration as stop:
                return stop.value


def _closed_parameters(fn: Callable[..., Any]) -> Mapping[str, ClosedSet]:
    """``fn``'s parameters annotated with a closed set's ``Literal`` type (faccel._choices), by name."""
    found = {}
    for name, annotation in fn.__annotations__.items():
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        for alias, closed in CLOSED_SETS.items():
            if name != "return" and re.search(rf"\b{alias}\b", text):
                found[name] = closed
    return found


def _check_words(fn: Callable[..., Any], closed: Mapping[str, ClosedSet], args: Any, kwargs: Any) -> None:
    """A word given for a closed set's parameter is one of its words (a bad value), before the type check.

    Only strings are checked here: another type is the type check's to name (an ``ArgumentError``).
    """
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return  # a missing or unexpected argument: the call itself reports it
    for name, check in closed.items():
        value = bound.arguments.get(name)
        if isinstance(value, str):
            check.check(value)
