"""Exceptions raised by faccel.

Every error is a :class:`FaccelError` and also the builtin it refines, so
``except ValueError`` keeps working for callers that do not know faccel.
Messages say what was expected, what was received, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "AccumulationError",
    "ArgumentError",
    "ArgumentValueError",
    "BatchSizeError",
    "CheckpointError",
    "CheckpointWarning",
    "DistributedError",
    "FaccelError",
    "FunctionalError",
    "LaunchError",
    "MissingExtraError",
    "PrecisionError",
    "PrepareError",
    "RankFailedError",
    "SetupMismatchError",
    "StorageError",
    "UsageError",
]


class FaccelError(Exception):
    """Base class of every error faccel raises on purpose."""


class ArgumentError(FaccelError, TypeError):
    """An argument has the wrong type, or lacks what the call needs of its type.

    Cause: e.g. ``detect(seed="0")``, ``prepare(dist=None, ...)``,
    ``TrainState(step=1.0)``, a collective's tree with a leaf that is not a
    tensor, or ``len()`` of a loader whose ``IterableDataset`` has no ``__len__``.
    Fix: pass the type the message names (the function's signature shows it).
    """


class ArgumentValueError(FaccelError, ValueError):
    """An argument has the right type but a value faccel cannot use.

    Cause: e.g. ``reduce(dist, t, op="avg")``, a seed outside NumPy's
    ``[0, 2**32)``, dict values of different lengths given to
    ``split_between_processes``, a negative ``TrainState`` step, a
    ``Sharding`` with ``batch_size=0``, or outputs given to
    ``gather_for_metrics`` whose rows do not match the loader's plan.
    Fix: pass a value in the range the message names.
    """


class LaunchError(ArgumentValueError):
    """The launcher's environment is malformed or contradicts itself.

    Cause: a variable such as ``RANK`` or ``SLURM_NTASKS`` is not an integer,
    is out of range, is missing a partner (``WORLD_SIZE`` without ``RANK``),
    or two launchers report different ranks for this process; an unknown
    ``strategy``. A bad value, so an :class:`ArgumentValueError` too.
    Fix: correct the variable the message names, or launch with ``torchrun``.
    """


class DistributedError(FaccelError, RuntimeError):
    """The process group could not be started, or is in a state faccel cannot use.

    Cause: an existing default process group disagrees with the ``DistState``
    (another rank or world size), or a collective needs a group that is not
    running. Fix: call :func:`faccel.detect` once per process, before any
    collective, and :func:`faccel.shutdown` at the end.
    """


class RankFailedError(DistributedError):
    """Another rank left (it crashed, was killed, or stopped answering) inside a collective step.

    Cause: a peer process ended during a step whose collectives faccel does
    not run itself (DeepSpeed's backward and optimizer step); the backend
    reported the lost connection. The message names this rank, the step, the
    other ranks and their last faccel calls.
    Fix: that rank's own log holds the first error; restart the job from the
    latest checkpoint.
    """


class PrepareError(FaccelError, TypeError):
    """An object given to :func:`faccel.prepare` cannot be prepared as asked.

    Cause: a loader whose order cannot be made the same on every rank (a
    ``DistributedSampler``, a sampler with hidden random state), ``split_batches``
    with a batch size the world size does not divide, or an object prepared
    under a different ``DistState``.
    Fix: follow the message; most cases name the argument to change.
    """


class SetupMismatchError(PrepareError):
    """The ranks gave :func:`faccel.prepare` different set-ups; raised on every rank alike.

    Cause: a model built differently on one rank (another width, an extra
    layer, another dtype), an optimizer with other groups or hyper-parameters,
    a loader of another length or batch size, a ``DistState`` that differs (a
    ``FACCEL_PRECISION`` set on one node only), or another number or kind of
    objects in one ``prepare`` call. The message names the rank and the first
    item that differs: ``rank 1: parameter 0.weight has shape [24, 8], rank 0
    has [16, 8]``. Checked before anything is wrapped or sharded.
    Fix: build every object from the same config on every rank, and make the
    same ``prepare`` calls in the same order on every rank.
    """


class PrecisionError(ArgumentValueError):
    """A precision setting is unknown or a precision step is missing a piece.

    Cause: ``precision`` not one of ``'no'``, ``'bf16'``, ``'fp16'``, or fp16
    training without a gradient scaler. An unknown precision is a bad value,
    so an :class:`ArgumentValueError` too. Fix: as the message says.
    """


class AccumulationError(FaccelError, ValueError):
    """Gradient accumulation was asked for but a piece of it is missing or out of range.

    Cause: ``accumulation_steps > 1`` and ``backward`` called without the
    micro-step (so it cannot scale the loss), or a micro-step index outside
    the epoch. Fix: iterate ``faccel.micro_batches(dist, loader)`` and pass
    ``micro=`` to ``backward``.
    """


class UsageError(FaccelError, RuntimeError):
    """Calls in an order or combination that would silently give a wrong result.

    Raised, for example, when a shuffled prepared loader is iterated a second
    time without naming an epoch. Fix: the message names the call to make
    instead (here ``loader.at(epoch=e)``).
    """


class CheckpointError(FaccelError, ValueError):
    """A checkpoint or saved model is missing, corrupted, foreign or mismatched.

    Cause: a file is absent, truncated or altered (its checksum differs), the
    format version is unknown, or the saved keys, shapes or dtypes do not
    match the objects being restored. Nothing has been modified when this is
    raised. Fix: restore from another checkpoint, or build the objects with
    the same architecture as when the checkpoint was written.

    Also the checkpoint mistakes: a step that already exists (advance
    ``state.step``, or pass ``replace=True``), a path that is a file, extras
    that differ between ranks (use ``rank_extras``), a call made on some
    ranks only (every rank must call; ``arrival_timeout``), a meeting of the
    ranks past the process group's timeout (``faccel.detect(timeout=...)``),
    and a mid-epoch checkpoint restored at another world size without its
    global data position (save with ``TrainState.loader``).
    """


class FunctionalError(FaccelError, ValueError):
    """A functional-training call (pytrees, pure optimizers) got inconsistent input.

    Cause: gradients, parameters and optimizer state whose tree structures
    differ, saved optimizer state that does not fit, or the ``"autograd"``
    engine inside a ``torch.func`` transform. Fix: build the state with the
    same optimizer's ``init(params)`` and pass trees of the same shape. (A bad
    hyperparameter is an :class:`ArgumentValueError`, a bad type an
    :class:`ArgumentError`.)
    """


class DeepSpeedConfigError(FaccelError, ValueError):
    """A DeepSpeed config that contradicts faccel, or one faccel cannot complete.

    Cause: a value the config states (``gradient_accumulation_steps``,
    ``train_micro_batch_size_per_gpu``, ``train_batch_size``, ``fp16`` /
    ``bf16``) differs from the one faccel knows (``dist.accumulation_steps``,
    the prepared loader's batch size, ``dist.precision``), or the config's
    ``optimizer`` / ``scheduler`` section and what ``prepare`` was given
    disagree (a section without its ``faccel.ConfigOptimizer`` /
    ``faccel.ConfigScheduler``, or the other way round), or the section names
    an optimizer with no kernel on this device, or it is not a JSON object.
    Fix: remove the key (or set it to ``"auto"``) and faccel fills it; pass the
    record for each section, or remove the section and pass the torch object
    (docs/deepspeed.md).
    """


class StorageError(FaccelError, OSError):
    """Files could not be written: the operating system refused.

    Cause: a full disk, a missing permission, a path that is not a folder, on
    the rank that wrote (the message names it and keeps the ``OSError`` as its
    cause), or such a failure on another rank. Raised by :func:`faccel.save_model`.
    Fix: free space or correct the path or permissions, then save again.
    """


class MissingExtraError(FaccelError, ImportError):
    """A root given as a URL whose storage needs an optional extra that is not installed.

    Cause: ``s3://`` needs ``s3fs`` and ``gs://`` needs ``gcsfs`` (through
    ``fsspec``), which faccel does not install by default. Fix: install the
    extra the message names, e.g. ``pip install 'faccel[s3]'``
    (docs/object-storage.md).
    """


class BatchSizeError(FaccelError, RuntimeError):
    """No batch size fits: :func:`faccel.find_executable_batch_size` shrank it to zero.

    Cause: the function raised an out-of-memory error at every batch size down
    to 1 (or at the only one tried). Fix: a smaller model or sequence, another
    precision, sharding (``strategy="fsdp"``), or a larger device; the message
    lists the sizes tried.
    """


class CheckpointWarning(UserWarning):
    """A checkpoint was passed over: ``restore(root)`` used an older one.

    Cause: the latest checkpoint under the root failed its check (a file
    missing, truncated or altered), so :func:`faccel.restore` fell back to
    the newest complete one; the message names both. Not a :class:`FaccelError`:
    the restore succeeded. Fix: delete or inspect the broken folder; to make
    it an error, ``warnings.simplefilter("error", faccel.errors.CheckpointWarning)``.
    """
