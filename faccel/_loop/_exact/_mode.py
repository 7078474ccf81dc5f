"""Exact mode: the same gradient bits at every data-parallel size (docs/exact.md).

``faccel.micro_batches(dist, loader, atoms=A, model=model)`` splits every
global batch into ``A`` atoms, whatever the number of ranks. Global position
``p`` of a batch goes to atom ``p % A``: the loader deals positions round
robin, so a rank ``r`` of ``W`` holds atoms ``r, r + W, ...`` and its local
atom ``i`` is the stride slice ``batch[i::A // W]``, the same samples in the
same order at every ``W``. Each atom's gradient is computed alone (same
shapes, same kernels), under an RNG seeded from ``(seed, epoch, position,
atom)``, into a flat buffer of -0.0 per dtype that the parameters' ``.grad``
view; the atoms are summed along ``_tree_reduce``'s one fixed tree, locally
then across ranks by point-to-point messages (on CPU processes each bucket's
first round posted during the step's last backward, from a hook on the
parameters). After the step's last ``faccel.backward`` every rank's
``.grad`` holds the bits one process gets.

What lives here: the checks made when the iteration starts (:class:`ExactRun`,
one per ``micro_batches`` iteration: the parameters' flat layout and its
buffer pool), and the live accumulator of one optimizer step
(:class:`AtomGroup`) that each exact :class:`~faccel.MicroStep` carries in
``micro.atom.group``. ``faccel.backward`` hands each atom's piece to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._data._loader import PreparedLoader
from faccel._dist._process_group import comm_device
from faccel._dist._state import DistState
from faccel._loop._exact._tree_reduce import Exchange, TreeStack, bit_reversed, is_power_of_two, scratch_for
from faccel._loop._micro_step import Atom, MicroStep
from faccel._loop._model import is_sharded, unwrap_model
from faccel._tree import map_tensors
from faccel.errors import ArgumentError, ArgumentValueError, UsageError

__all__ = ["Atom", "AtomGroup", "ExactRun", "atom_seed", "exact_problem"]

# Marks the atom seeds apart from the loader's per-batch seeds (4-tuples), which hash the same way.
_ATOM_TAG = 0xA70


def atom_seed(seed: int, epoch: int, position: int, atom: int) -> int:
    """The RNG seed of atom ``atom`` of the batch at global ``position`` of ``epoch``. Pure.

    The position counts samples of the epoch's order consumed before the batch
    (by all ranks), so it is the same at every world size and after a resume
    at another one. ``hash`` of a tuple of ints does not depend on
    ``PYTHONHASHSEED``.

    Example:
        >>> atom_seed(0, 0, 16, 3) == atom_seed(0, 0, 16, 3) != atom_seed(0, 0, 16, 4)
        True
    """
    return hash((seed, epoch, position, atom, _ATOM_TAG)) & (2**63 - 1)


def exact_problem(*, atoms: Any, data_world_size: int, batch_size: int, remaining: int, padding: int) -> str:
    """Why a loader cannot be split into ``atoms`` atoms at this size, or ``""``. Pure.

    Args:
        atoms: The atom count asked for.
        data_world_size: Data-parallel ranks.
        batch_size: Samples per rank per batch.
        remaining: Positions of the epoch still to deal (all ranks).
        padding: Samples the loader repeats to even the ranks' batches.

    Example:
        >>> exact_problem(atoms=8, data_world_size=2, batch_size=8, remaining=64, padding=0)
        ''
        >>> exact_problem(atoms=8, data_world_size=3, batch_size=8, remaining=64, padding=0)[:40]
        'the data-parallel size 3 must be a power'
    """
    w = data_world_size
    if not is_power_of_two(atoms):
        return f"atoms must be a power of two (1, 2, 4, 8 ...), got {atoms!r}"
    if not is_power_of_two(w) or atoms % w:
        return (
            f"the data-parallel size {w} must be a power of two that divides atoms={atoms}: each rank "
            "computes a whole subtree of the fixed tree; run on 1, 2, 4 ... up to atoms processes"
        )
    if batch_size % (atoms // w):
        return (
            f"each rank's batch of {batch_size} must split into atoms / ranks = {atoms // w} equal atoms; "
            f"use a global batch (batch_size x ranks = {batch_size * w}) that atoms={atoms} divides"
        )
    if padding:
        return (
            f"the loader repeats {padding} sample(s) to even the ranks' batches, and which ones depends "
            "on the world size; prepare the DataLoader with drop_last=True, or use a dataset whose "
            f"length atoms={atoms} divides"
        )
    if remaining % atoms:
        return (
            f"the epoch's last batch would hold {remaining % (batch_size * w)} samples, which "
            f"atoms={atoms} does not divide; prepare the DataLoader with drop_last=True, or use a "
            "dataset whose length the global batch divides"
        )
    return ""


# A bucket of the exchange closes once it holds this many elements (4 MB of float32): the first
# round of a bucket starts as soon as the last atom's backward has summed its parameters' gradients.
BUCKET = 1 << 20


class _Layout(NamedTuple):
    """Where each parameter's gradient sits in the flat buffer of its dtype, and the exchange's buckets."""

    params: list[torch.Tensor]
    bucket: list[int]  # the flat buffer (dtype) of each parameter
    offset: list[int]
    sizes: list[int]  # elements per flat buffer
    dtypes: list[torch.dtype]
    spans: list[tuple[int, int, int]]  # each exchange bucket: (flat buffer, start, end)
    span_of: list[int]  # the exchange bucket of each parameter
    members: list[int]  # parameters per exchange bucket


def _layout(params: Sequence[torch.Tensor], bucket_size: int = BUCKET) -> _Layout:
    """The flat layout; exchange buckets are runs of parameters taken from the last, as a backward finds them.

    Example:
        >>> ps = [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(4), torch.zeros(5)]
        >>> lay = _layout(ps, bucket_size=6)
        >>> lay.offset, lay.sizes, lay.spans, lay.span_of
        ([0, 0, 3, 7], [12, 2], [(0, 3, 12), (1, 0, 2), (0, 0, 3)], [2, 1, 0, 0])
    """
    dtypes: list[torch.dtype] = []
    sizes: list[int] = []
    bucket, offset = [], []
    for p in params:
        if p.dtype not in dtypes:
            dtypes.append(p.dtype)
            sizes.append(0)
        b = dtypes.index(p.dtype)
        bucket.append(b)
        offset.append(sizes[b])
        sizes[b] += p.numel()
    spans: list[tuple[int, int, int]] = []
    span_of = [0] * len(params)
    members: list[int] = []
    for i in reversed(range(len(params))):
        b, start, end = bucket[i], offset[i], offset[i] + params[i].numel()
        last = spans[-1] if spans else None
        # Params of one dtype lie in order in its buffer: a run of them taken backwards is contiguous.
        if last is not None and last[0] == b and last[1] == end and last[2] - last[1] < bucket_size:
            spans[-1] = (b, start, last[2])
            members[-1] += 1
        else:
            spans.append((b, start, end))
            members.append(1)
        span_of[i] = len(spans) - 1
    return _Layout(list(params), bucket, offset, sizes, dtypes, spans, span_of, members)


class _Pool:
    """Exact mode's buffers for one model and layout, kept in ``dist.runtime`` from iteration to iteration."""

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        self.free: list[list[torch.Tensor]] = []
        self.granted: list[torch.Tensor] | None = None  # the buffers the .grad of the last step view
        self.scratch: list[torch.Tensor] | None = None  # the exchange's receive space
        # Start each bucket's exchange during the step's last backward (hooks on the parameters).
        self.overlap = False
        self.handles: list[Any] = []  # the hooks (held by dist.runtime too)
        self.armed: AtomGroup | None = None  # the step whose last backward is running
        self.started_early = 0  # buckets the last step started during its backward

    def ready(self, index: int) -> None:
        """The hook: parameter ``index`` has its gradient of the current backward."""
        group = self.armed
        if group is not None:
            group.ready(index)


def _pool(dist: DistState, model: nn.Module, layout: _Layout, device: torch.device) -> _Pool:
    """The pool of ``model``'s buffers in this run (a new one when its layout changed)."""
    # The parameters themselves too: the hooks number them (their ids are unique while the model holds them).
    ids = tuple(map(id, layout.params))
    key = (tuple(layout.sizes), tuple(layout.dtypes), device, dist.data_world_size, ids)
    pool = dist.runtime.exact.get(model)
    if not isinstance(pool, _Pool) or pool.key != key:
        if isinstance(pool, _Pool):
            for handle in pool.handles:
                dist.runtime.release(handle)
        pool = dist.runtime.exact[model] = _Pool(key)
        if dist.data_world_size > 1 and device.type == "cpu":
            # Overlap the exchange with the last backward: one post-accumulate-grad hook per parameter
            # (EXACT_BUCKET_READY), held by dist.runtime so that shutdown removes it. CPU only: on CUDA
            # the hook would run on autograd's device thread, untested here, so the exchange follows it.
            pool.overlap = True
            for index, param in enumerate(layout.params):
                hook = _bucket_ready_hook(pool, index)
                pool.handles.append(dist.runtime.hold(param.register_post_accumulate_grad_hook(hook)))
    return pool


def _bucket_ready_hook(pool: _Pool, index: int) -> Any:
    def bucket_ready(_param: torch.Tensor) -> None:  # faccel._marks.EXACT_BUCKET_READY
        pool.ready(index)

    return bucket_ready


def _problem_of_setup(dist: DistState, model: nn.Module) -> str:
    if dist.data_world_size != dist.world_size:
        return (
            f"exact mode needs every rank to be a data-parallel replica, got layout {dist.parallel}: "
            "tensor parallelism and pipelines split a forward over ranks with reductions whose order "
            "exact mode does not control; use a plain DDP run"
        )
    if dist.strategy != "ddp" or is_sharded(model):
        return (
            f"exact mode needs DDP or one process, got strategy={dist.strategy!r}"
            + (" with sharded (FSDP2 or tensor-parallel) parameters" if is_sharded(model) else "")
            + ": FSDP2 reduce-scatters each backward's unsharded gradient in the collective's own order "
            "inside autograd, and keeping each atom's unsharded gradient apart to sum it in a fixed "
            "tree would hold the whole model per rank (the memory FSDP2 saves); DeepSpeed reduces "
            "inside its engine. Use strategy='ddp'"
        )
    if comm_device(dist) != dist.device:
        return (
            f"exact mode exchanges gradients on the training device, but backend {dist.backend!r} moves "
            f"tensors of {comm_device(dist)} and the model trains on {dist.device}; use the device's "
            "own backend (nccl for CUDA)"
        )
    return ""


def _agree(dist: DistState) -> None:
    """Refuse, on every rank alike, a run whose ranks may compute an atom differently."""
    import torch.distributed as tdist

    deterministic = torch.are_deterministic_algorithms_enabled()
    mine = torch.tensor([torch.get_num_threads(), int(deterministic)], dtype=torch.int64)
    if dist.distributed:
        device = comm_device(dist)
        gathered = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(dist.world_size)]
        tdist.all_gather(gathered, mine.to(device))
        rows = [tuple(int(v) for v in g.tolist()) for g in gathered]
    else:
        rows = [(int(mine[0]), int(mine[1]))]
    threads = [row[0] for row in rows]
    if dist.device.type == "cpu" and len(set(threads)) > 1:
        msg = (
            f"exact mode needs the same torch thread count on every rank (a CPU kernel may split a sum "
            f"by threads), got torch.get_num_threads() = {threads} by rank; set OMP_NUM_THREADS (or "
            "torch.set_num_threads) to one value for every process, and the same value at every size"
        )
        raise UsageError(msg)
    if dist.device.type != "cpu" and not all(row[1] for row in rows):
        flags = [bool(row[1]) for row in rows]
        msg = (
            f"exact mode on {dist.device.type} needs deterministic algorithms on every rank, got "
            f"torch.are_deterministic_algorithms_enabled() = {flags} by rank; call "
            "torch.use_deterministic_algorithms(True) (and set CUBLAS_WORKSPACE_CONFIG=:4096:8) "
            "before training"
        )
        raise UsageError(msg)


class ExactRun:
    """One iteration of ``micro_batches(..., atoms=A, model=model)``: the checks, the layout, the buffers.

    Made when the iteration starts; every check runs before any batch is read
    and decides the same on every rank (the loader's arithmetic is the same
    everywhere, the thread counts are gathered), so a refusal never leaves a
    rank waiting on another.
    """

    def __init__(self, dist: DistState, loader: Any, atoms: Any, model: Any) -> None:
        if not isinstance(model, nn.Module):
            msg = (
                f"micro_batches(..., atoms=...) needs model= (the prepared model whose gradients it sums), "
                f"got {type(model).__name__}"
            )
            raise ArgumentError(msg)
        if not isinstance(loader, PreparedLoader) or loader._recipe.kind == "stream":
            what = type(loader).__name__ if not isinstance(loader, PreparedLoader) else "an IterableDataset"
            msg = (
                f"exact mode reads the global position of every sample from the loader faccel.prepare "
                f"returned for a map-style dataset, got {what}; prepare a DataLoader over a Dataset"
            )
            raise ArgumentError(msg)
        if loader.batch_size is None:
            msg = (
                "exact mode splits batches of samples into atoms, but this loader's batches come whole "
                "(a batch sampler, or batch_size=None); give the DataLoader a batch_size"
            )
            raise ArgumentValueError(msg)
        problem = _problem_of_setup(dist, model)
        if problem:
            raise UsageError(problem)
        s = loader.sharding
        problem = exact_problem(
            atoms=atoms,
            data_world_size=dist.data_world_size,
            batch_size=s.batch_size,
            remaining=s.total - s.consumed,
            padding=loader.padding,
        )
        if problem:
            raise ArgumentValueError(problem)
        _agree(dist)
        self.dist = dist
        self.model = model
        self.atoms: int = atoms
        self.world = dist.data_world_size if dist.distributed else 1
        self.rank = dist.data_rank if dist.distributed else 0
        self.local = atoms // dist.data_world_size  # atoms per rank (simulated ranks too)
        self.first_atom = dist.data_rank
        self.stride = dist.data_world_size
        self.epoch = loader.epoch
        self.consumed = loader.consumed
        self.global_batch = s.batch_size * s.world_size
        self.layout = _layout([p for p in unwrap_model(model).parameters() if p.requires_grad], BUCKET)
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self.device = self.layout.params[0].device if self.layout.params else dist.device
        self._pool = _pool(dist, model, self.layout, self.device)

    # -- buffers -------------------------------------------------------------------------------------
    def take(self) -> list[torch.Tensor]:
        """Flat buffers of -0.0 (one per dtype, then the float64 loss slot), reused where possible.

        -0.0, not +0.0: it is IEEE-754's exact additive identity (``-0.0 + g`` is ``g`` for
        every ``g``, -0.0 included), so an atom's gradient accumulated into it is the raw
        gradient, the same bits whether it lands in a fresh buffer or into its left
        neighbour's (``_fused``). The pool outlives this iteration (``dist.runtime``), so
        buffers are allocated once per run, not at every iteration's first step.
        """
        if self._pool.free:
            buffers = self._pool.free.pop()
            for b in buffers:
                b.fill_(-0.0)
            return buffers
        lay = self.layout
        flats = [
            torch.full((n,), -0.0, dtype=d, device=self.device)
            for n, d in zip(lay.sizes, lay.dtypes, strict=True)
        ]
        return [*flats, torch.full((1,), -0.0, dtype=torch.float64, device=self.device)]

    def release(self, buffers: list[torch.Tensor]) -> None:
        self._pool.free.append(buffers)

    def pieces_of(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the exchange sends: each bucket's span of ``buffers``, then the loss slot."""
        return [*(buffers[b][start:end] for b, start, end in self.layout.spans), buffers[-1]]

    def scratch(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """The exchange's receive space (half of each piece), made once per run."""
        if self._pool.scratch is None:
            self._pool.scratch = scratch_for(buffers, self.world)
        return self._pool.scratch

    def point_grads(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Make each parameter's ``.grad`` a view of ``buffers``; return the views."""
        views = []
        lay = self.layout
        for p, b, o in zip(lay.params, lay.bucket, lay.offset, strict=True):
            view = buffers[b][o : o + p.numel()].view_as(p)
            p.grad = view
            views.append(view)
        return views

    def grant(self, buffers: list[torch.Tensor]) -> None:
        """The step's sum becomes ``.grad``; the previous step's buffers return to the pool."""
        if self._pool.granted is not None and self._pool.granted is not buffers:
            self.release(self._pool.granted)
        self.point_grads(buffers)
        self._pool.granted = buffers

    # -- batches -------------------------------------------------------------------------------------
    def split(self, batch: Any, i: int) -> Any:
        """This rank's local atom ``i`` of ``batch``: the stride slice ``[i::atoms/ranks]``, contiguous."""
        step = self.local
        if step == 1:
            return batch
        return map_tensors(lambda t: t[i::step].contiguous(), batch)

    def position(self, index: int) -> int:
        """The global position of the epoch where local batch ``index`` starts."""
        return self.consumed + index * self.global_batch

    def pieces(self, first: int, batches: list[Any], items: int | None) -> Iterator[tuple[MicroStep, Any]]:
        """The group's atoms (in the tree's order), each atom's pieces (batches) one after the other."""
        group = AtomGroup(self, len(batches))
        size = len(batches)
        order = bit_reversed(self.local)
        positions = [self.position(first + m) for m in range(size)]
        try:
            for j, i in enumerate(order):
                atom = self.first_atom + i * self.stride
                group.begin_atom(j)
                for m, batch in enumerate(batches):
                    seed = atom_seed(self.dist.seed, self.epoch, positions[m], atom)
                    piece = self.split(batch, i)
                    last = m == size - 1
                    info = Atom(index=atom, piece=m, last=last, seed=seed, group=group)
                    sync = last and j == len(order) - 1
                    group.enter(seed)
                    if sync:
                        group.arm()
                    micro = MicroStep(index=first + m, sync=sync, group_size=size, items=items, atom=info)
                    yield micro, piece
                    group.leave()
        finally:
            group.restore()
            group.disarm()


class AtomGroup:
    """The live accumulator of one optimizer step in exact mode (``micro.atom.group``).

    It owns the parameters' ``.grad`` during the step: each atom starts from
    buffers of -0.0 that ``.grad`` views, its pieces accumulate there, then the
    buffers join the tree. After the step's last ``faccel.backward``,
    ``.grad`` views the tree's sum (the same bits on every rank and at every
    size) and :attr:`loss` holds the step's loss as a float64 scalar tensor.
    """

    def __init__(self, run: ExactRun, size: int) -> None:
        self.run = run
        self.size = size
        self.loss: torch.Tensor | None = None
        self._stack = TreeStack(run.release)
        self._current: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._entered = 0
        self._done = 0
        self._place = 0  # the current atom's place in the push order
        self._pending: list[torch.Tensor] = []  # a left leaf waiting for its right one
        # The step's last backward, when its exchange overlaps it (arm): the stack entries the last
        # leaf merges into, its level, the sum's buffers, the exchange, parameters each bucket awaits.
        self._chain: list[list[torch.Tensor]] = []
        self._level = 0
        self._exchange: Exchange | None = None
        self._awaited: list[int] = []

    @property
    def atoms(self) -> int:
        """The atom count of the run."""
        return self.run.atoms

    def _fused(self, j: int) -> bool:
        """Whether leaf ``j`` (in push order) accumulates straight into leaf ``j - 1``'s buffers.

        A leaf of one piece at an odd place is the right operand of its pair: autograd's
        in-place accumulation (``grad += new``) into the left leaf's buffers is the very
        addition the tree makes, element by element, and saves a zeroed buffer and a pass.
        """
        return self.size == 1 and j % 2 == 1

    def begin_atom(self, j: int) -> None:
        self._place = j
        if self._fused(j):
            self._current = self._pending
            self._pending = []
        else:
            self._current = self.run.take()
        self._views = self.run.point_grads(self._current)

    def arm(self) -> None:
        """Before the step's last piece: have its backward start each bucket's exchange when ready."""
        run = self.run
        pool = run._pool
        if not pool.overlap:
            return
        self._level = 1 if self._fused(self._place) else 0
        self._chain = self._stack.chain(self._level)
        total = self._chain[-1] if self._chain else self._current
        pieces = run.pieces_of(total)
        self._exchange = Exchange(pieces, run.rank, run.world, scratch=run.scratch(pieces))
        self._awaited = list(run.layout.members)
        pool.started_early = 0
        pool.armed = self

    def disarm(self) -> None:
        """No backward of this step starts an exchange any more."""
        if self.run._pool.armed is self:
            self.run._pool.armed = None

    def ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is final: once its bucket's are, sum the bucket and send it."""
        bucket = self.run.layout.span_of[index]
        self._awaited[bucket] -= 1
        if self._awaited[bucket] == 0 and self._exchange is not None:
            self._merge(bucket)
            self._exchange.start([bucket])
            self.run._pool.started_early += 1

    def _merge(self, bucket: int) -> None:
        """The tree's last additions over one bucket's span (the loss slot: ``bucket == len(spans)``)."""
        spans = self.run.layout.spans
        b, start, end = spans[bucket] if bucket < len(spans) else (-1, 0, 1)
        value = self._current[b][start:end]
        for left in self._chain:
            target = left[b][start:end]
            target.add_(value)
            value = target

    def enter(self, seed: int) -> None:
        """Seed torch's generators for a piece, keeping the caller's states to restore after it."""
        device = self.run.dist.device
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self._saved = (torch.get_rng_state(), cuda)
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        self._entered += 1

    def restore(self) -> None:
        """Put back the generators' states from before the piece (once)."""
        if self._saved is None:
            return
        cpu, cuda = self._saved
        self._saved = None
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.run.dist.device)

    def leave(self) -> None:
        self.restore()
        if self._done != self._entered:
            msg = (
                "in exact mode every micro-step's loss must go through faccel.backward(dist, loss, "
                "micro=micro) before the next one: a skipped piece would leave its atom short"
            )
            raise UsageError(msg)

    def check_no_sync(self) -> None:
        """DDP must not all-reduce an atom (its order is the backend's, and it averages)."""
        ddp = self.run._ddp
        if ddp is not None and self.run.dist.distributed and ddp.require_backward_grad_sync:
            msg = (
                "exact mode sums the atoms itself, but DDP was about to all-reduce this backward: run "
                "the forward and backward inside `with faccel.accumulate(dist, model, micro):`"
            )
            raise UsageError(msg)

    def done(self, micro: MicroStep, loss: torch.Tensor) -> None:
        """After a piece's backward: count its loss; push the atom when whole; sum the step at its end."""
        self.restore()
        self._done += 1
        current = self._current
        current[-1].add_(loss.detach().to(torch.float64).reshape(1))
        atom = micro.atom
        if not atom.last:  # type: ignore[union-attr]
            return
        for p, view in zip(self.run.layout.params, self._views, strict=True):
            if p.grad is not view:
                msg = (
                    "a parameter's .grad was replaced during an exact step (optimizer.zero_grad() inside "
                    "the group?); exact mode owns .grad from the first micro-step of a step to its last: "
                    "zero gradients after optimizer_step, or not at all"
                )
                raise UsageError(msg)
        if self._exchange is not None and micro.sync:
            self._finish_overlapped()
            return
        self._current = []
        j = self._place
        if self._fused(j + 1) and j + 1 < self.run.local:
            self._pending = current  # the next leaf adds itself into these buffers
            return
        self._stack.push(current, level=1 if self._fused(j) else 0)
        if micro.sync:
            self._finish()

    def _finish(self) -> None:
        total = self._stack.result()
        run = self.run
        if run.world > 1:
            pieces = run.pieces_of(total)
            Exchange(pieces, run.rank, run.world, scratch=run.scratch(pieces)).finish()
        run.grant(total)
        self.loss = total[-1][0].clone()

    def _finish_overlapped(self) -> None:
        """The last backward started the buckets it finished; sum and send the rest, then wait for all."""
        exchange, self._exchange = self._exchange, None
        assert exchange is not None
        self.disarm()
        started = exchange.started
        for bucket in range(len(self.run.layout.spans) + 1):
            if bucket not in started:  # the loss slot, and any bucket a parameter left unused
                self._merge(bucket)
        current, self._current = self._current, []
        self._stack.settle(current, self._level)
        total = self._stack.result()
        exchange.finish()
        self.run.grant(total)
        self.loss = total[-1][0].clone()
