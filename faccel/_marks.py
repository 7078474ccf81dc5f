"""Every mark faccel sets, hook it registers, group and thread it makes, and what undoes each.

faccel keeps no module-level state and no registry of your objects; the few
facts that must travel with one of your objects, to whichever later call
receives it (possibly with another ``DistState``), are set on the object
itself, under these names, and nowhere else:

- ``_faccel_wrapped_as`` (:data:`WRAPPED_AS`), on a module ``prepare``
  wrapped (DDP, FSDP2 or the autocast wrapper): a weak reference to the
  wrapper, set with ``object.__setattr__`` (``nn.Module``'s own would register
  the wrapper as a submodule). Preparing the same module again returns that
  wrapper, instead of a second DDP that would reduce its gradients twice.
- ``_faccel_tensor_parallel`` (:data:`TENSOR_PARALLEL`), on a module whose
  layers faccel split over the ``tensor`` dimension without FSDP2: ``True``.
  ``checkpoint``, ``restore`` and ``save_model`` read it to treat the model's
  DTensor parameters as faccel's (FSDP2 modules are recognised by their class).
- ``_faccel_replaced_by`` (:data:`REPLACED_BY`), on a parameter that preparing
  its module replaced by another object (FSDP2's DTensor parameters;
  ``Module.to()`` for some devices): the parameter that replaced it, so an
  optimizer holding the old one, prepared in the same or a later call, is
  pointed at the new one.
- ``_faccel_deepspeed_engine`` (:data:`DEEPSPEED_ENGINE`), on each parameter of
  a DeepSpeed engine's module (``strategy='deepspeed'``): a weak reference to the
  engine, so ``backward`` finds the engine from the loss's graph.
- ``_faccel_process_group`` (:data:`PROCESS_GROUP`), on each
  ``DistributedDataParallel`` wrapper ``prepare`` made, set with
  ``object.__setattr__`` after the wrapper is built: a pin holding the
  wrapper's process group (its copies and pickles get an empty pin). Freeing
  the wrapper then drops its C++ reducer's hold on the group before this
  one, so the group's last holder is a Python object, whose release torch
  makes without the interpreter lock: the gloo group's destructor joins its
  worker threads, and one of them may need that lock to free the last
  collective's tensors (a rank that never exited: tests/distributed/test_exit.py).
- ``_faccel_other_stage`` (:data:`OTHER_STAGE`), on each parameter of a
  pipelined model that another pipeline stage holds (``prepare(...,
  split=...)`` under ``pipeline > 1``): ``True``, so an optimizer built over the
  whole model drops it (this rank never computes its gradient).
- ``_faccel_whole_groups`` (:data:`WHOLE_GROUPS`), on an optimizer whose param
  groups lost another stage's parameters that way: each group's parameters as
  given (every stage's), so that a checkpoint numbers the optimizer state as
  the whole model's optimizer does, and restores at any layout.
- ``_faccel_written_by`` (:data:`WRITTEN_BY`), not on an object of yours: on
  each tensor of a pipelined model's sharded checkpoint plan (this rank's
  stages' tensors, detached, and the ``meta`` tensors that stand in for
  another stage's): where it lies, a ``Held`` (the ranks of its stage that
  write its chunks of rows, and the chunk this rank writes)
  (``faccel._checkpoint._strategies._pipeline``).
- ``_faccel_expert_shard`` (:data:`EXPERT_SHARD`), on each experts module that
  expert parallelism split (``Layout(expert=...)``; ``faccel._loop._strategies._experts``):
  its ``ExpertShard`` (the layer's expert count, the group's size, this rank's
  block), read by the dispatch, by a second ``prepare`` (not split twice), and
  by the DDP and FSDP2 wrappers (which leave the split experts to their own
  units). Checkpoints and exports do not read it: the split parameters are
  DTensors, which carry their whole shapes and this rank's rows themselves. Its
  ``forward`` is then the dispatch (the instance attribute below).
- ``forward``, on each submodule that ``prepare(..., activation_checkpointing=...)``
  selected (only when you ask for it): an instance attribute, set with
  ``object.__setattr__``, that runs the class's own ``forward`` through
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
  (``faccel._loop._activation_checkpoint``). The class, the parameters and the
  ``state_dict`` keys are untouched; ``del module.forward`` removes it. It is
  the one attribute faccel sets under a name of PyTorch's, because the module
  must stay where it is in your tree (a wrapper module in its place would rename
  every parameter under it).

Three hooks, registered through torch's own ``register_*_hook`` and held (their
``RemovableHandle``) in ``dist.runtime``, which removes them at
:func:`faccel.shutdown`; no other hook is registered on your objects:

- ``faccel: evaluation check-in`` (:data:`EVAL_CHECK_IN`), a forward pre-hook
  on a model sharded over processes (FSDP2, or tensor parallelism): when the
  model's forwards switch between with and without gradients (the first
  evaluation forward after training, the first training forward after an
  evaluation), the ranks check in on a gloo group of faccel's own
  (:data:`CHECK_IN_GROUP`, one per ``dist.runtime``) before the forward
  gathers parameters. A forward on some ranks only (evaluation under ``if
  dist.is_main_process``) then ends in a named ``DistributedError`` instead of
  a hang or gloo's abort; forwards in a row of the same kind (a whole
  evaluation, generation token by token, training) pay one bool comparison
  (``faccel._loop._check_in``).
- ``faccel: rebind at first step`` (:data:`REBIND_AT_FIRST_STEP`), an optimizer
  step pre-hook, only on an optimizer prepared before its FSDP2 or
  tensor-parallel model in an earlier ``prepare`` call: just before the first
  ``step()`` it points the optimizer at the parameters sharding made, then
  removes itself.
- ``faccel: exact bucket ready`` (:data:`EXACT_BUCKET_READY`), a
  post-accumulate-grad hook on each parameter of a model trained in exact mode
  (``micro_batches(..., atoms=...)``) on more than one CPU process: during a
  step's last backward, once every parameter of a bucket has its gradient, it
  adds the bucket's last tree sums and posts the bucket's first round of the
  exchange, so the messages travel while the backward goes on (as DDP's own
  hooks do). Outside that backward it tests one attribute and returns
  (``faccel._loop._exact._mode``).

One hook on a wrapper faccel builds (not an object of yours), and its mark:

- ``comm_hook=`` of ``prepare`` (DDP's communication hooks: fp16, bf16,
  PowerSGD), registered with ``register_comm_hook`` on the
  ``DistributedDataParallel`` wrapper ``prepare`` made
  (``faccel._loop._strategies._ddp._comm_hooks``). torch has no way to take one off a DDP
  wrapper; it goes with the wrapper. A PowerSGD hook keeps buffers of the
  gradients' size (its error feedback, its warm-start matrices) in its
  state, marked on the wrapper as ``_faccel_comm_hook`` (:data:`COMM_HOOK`),
  set with ``object.__setattr__``; :func:`faccel.shutdown` empties them.

Process groups faccel makes, besides the default one (:data:`GROUPS`):

- :data:`CHECK_IN_GROUP`, a gloo group for the evaluation check-in, kept in
  ``dist.runtime.groups`` and dropped by :func:`faccel.shutdown`.
- The groups of the device meshes made for a layout (``faccel._dist._mesh``),
  and the data-parallel subgroups of a layout with tensor parallelism
  (``data_group``, made with ``new_subgroups_by_enumeration`` the first time
  a metric is combined over the data-parallel ranks): kept in
  ``dist.runtime.meshes``, dropped by :func:`faccel.shutdown` (the default
  group's destruction then ends them with it).

Threads faccel starts (:data:`THREADS`, by name), each joined by the call that
started it before that call returns, except a background checkpoint's, which
``checkpoint(..., blocking=False)`` returns with and the next checkpoint,
``restore`` or :func:`faccel.shutdown` joins:

- ``faccel-checkpoint``: a non-blocking checkpoint's writer (``faccel._dist._runtime``).
- ``faccel-hash``: hashes a file while it is written (``faccel._storage._durable``,
  ``faccel._checkpoint._sharded._shard_file``).
- ``faccel-sync``: flushes a file being written to the disk in the background
  (``faccel._storage._durable``).
- ``faccel-io``, ``faccel-read``: a checkpoint's parallel writes and reads
  (``faccel._storage._durable``, ``faccel._checkpoint._sharded._flow``).
- ``faccel-lease``: renews an object store's writer lease while it is held
  (``faccel._storage._objects``).
- ``faccel-save-model``: writes ``save_model``'s files while the next tensors
  are gathered (``faccel._hf._spread_write``).
- ``faccel-hang-record``: rewrites this rank's hang record when its phase changes, at most every
  0.25 s (``faccel._dist._runtime``); stopped and joined by :func:`faccel.shutdown`.

Nothing else of yours is changed, but what you ask for: ``prepare`` moves
your module to the device in place, and ``fully_shard`` (FSDP2) changes its
class and parameters in place, which is PyTorch's design. Your module's
class and its methods are never replaced (no monkey-patching): precision comes
from a thin outer module; activation checkpointing, only when asked for, adds
the instance ``forward`` above, which calls the class's.
"""

from __future__ import annotations

__all__ = [
    "CHECK_IN_GROUP",
    "COMM_HOOK",
    "DEEPSPEED_ENGINE",
    "EVAL_CHECK_IN",
    "EXACT_BUCKET_READY",
    "EXPERT_SHARD",
    "GROUPS",
    "HOOKS",
    "OTHER_STAGE",
    "PROCESS_GROUP",
    "REBIND_AT_FIRST_STEP",
    "REPLACED_BY",
    "TENSOR_PARALLEL",
    "THREADS",
    "WHOLE_GROUPS",
    "WRAPPED_AS",
    "WRITTEN_BY",
]

WRAPPED_AS = "_faccel_wrapped_as"
TENSOR_PARALLEL = "_faccel_tensor_parallel"
REPLACED_BY = "_faccel_replaced_by"
DEEPSPEED_ENGINE = "_faccel_deepspeed_engine"
PROCESS_GROUP = "_faccel_process_group"
# On each tensor of a pipelined model's sharded checkpoint plan: a Held, the ranks of its stage that
# write its chunks and this rank's chunk (faccel._checkpoint._strategies._pipeline).
WRITTEN_BY = "_faccel_written_by"
# On an optimizer that steps one pipeline stage: its param groups' parameters as given (every stage's),
# so that checkpoints number them as the whole model's optimizer does (faccel._loop._prepare._rebind).
WHOLE_GROUPS = "_faccel_whole_groups"

EVAL_CHECK_IN = "faccel: evaluation check-in"
REBIND_AT_FIRST_STEP = "faccel: rebind at first step"
EXACT_BUCKET_READY = "faccel: exact bucket ready"
#: Every hook faccel registers on a user's object (tests/test_no_module_state.py allows
#: ``register_*hook`` calls only where these are registered).
HOOKS = (EVAL_CHECK_IN, REBIND_AT_FIRST_STEP, EXACT_BUCKET_READY)
#: The name of the one process group faccel makes for itself, kept in ``dist.runtime.groups``.
CHECK_IN_GROUP = "evaluation check-in"
#: Every name of ``dist.runtime.groups`` (the meshes' groups are kept in ``dist.runtime.meshes``).
GROUPS = (CHECK_IN_GROUP,)
# On the DDP wrapper prepare made with a PowerSGD comm_hook: its PowerSGDState
# (faccel._loop._strategies._ddp._comm_hooks).
COMM_HOOK = "_faccel_comm_hook"
#: The name of every thread faccel starts (or the prefix of a pool's), each joined as the docstring says.
THREADS = (
    "faccel-checkpoint",
    "faccel-hash",
    "faccel-sync",
    "faccel-io",
    "faccel-read",
    "faccel-lease",
    "faccel-save-model",
    "faccel-hang-record",
)
OTHER_STAGE = "_faccel_other_stage"
# On each experts module that expert parallelism split: its ExpertShard
# (faccel._loop._strategies._experts._dispatch).
EXPERT_SHARD = "_faccel_expert_shard"
