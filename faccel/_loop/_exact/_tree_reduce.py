"""The one fixed summation tree of exact mode, and the exchange that follows it across ranks.

The tree over ``A`` leaves (a power of two) is

    tree(x) = tree(x[0::2]) + tree(x[1::2]),    tree([x0]) = x0

so at every level the leaves whose indices agree modulo ``2**k`` form one
subtree. A data-parallel rank ``r`` of ``W`` (a power of two dividing ``A``)
holds the leaves ``r, r + W, r + 2W, ...`` (the prepared loader deals global
positions round robin), which is exactly one node of that tree, whatever
``W``. Each rank sums its node (:class:`TreeStack`, a binary counter fed in
bit-reversed order, which is the same tree streamed with ``log2`` buffers),
then the ranks combine nodes along the upper levels of the same tree:
first with the rank ``W/2`` away, then ``W/4`` ... then 1 (recursive halving
of the buffer, then recursive doubling of the halves back: each element is
added in exactly the pairs and order one process uses; no ``all_reduce``,
whose order is the backend's). IEEE-754 addition is commutative bit for bit,
so which of two partners holds the left operand does not change a bit; the
grouping is what matters, and it is fixed.

Everything here but :func:`exchange` is pure, and :func:`simulate_exchange`
applies the same plans to in-memory tensors, so one process can prove the law
for any ``A`` and ``W`` (``tests/test_exact_tree.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

__all__ = [
    "Exchange",
    "Round",
    "TreeStack",
    "bit_reversed",
    "exchange",
    "is_power_of_two",
    "plan",
    "scratch_for",
    "simulate_exchange",
    "tree_sum",
]

T = TypeVar("T")


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8 ...

    Example:
        >>> [n for n in range(10) if is_power_of_two(n)]
        [1, 2, 4, 8]
    """
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def tree_sum(leaves: Sequence[T]) -> T:
    """The reference: ``tree(x[0::2]) + tree(x[1::2])``, what one process computes. Pure.

    Example:
        >>> tree_sum(["a", "b", "c", "d"])   # (a + c) + (b + d)
        'acbd'
    """
    if len(leaves) == 1:
        return leaves[0]
    return tree_sum(leaves[0::2]) + tree_sum(leaves[1::2])  # type: ignore[operator, no-any-return]


def bit_reversed(count: int) -> list[int]:
    """``range(count)`` in bit-reversed order: pushed in this order, a binary counter builds :func:`tree_sum`.

    Example:
        >>> bit_reversed(8)
        [0, 4, 2, 6, 1, 5, 3, 7]
    """
    bits = count.bit_length() - 1
    return [int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(count)]


class TreeStack:
    """A binary counter of partial sums: push leaves in :func:`bit_reversed` order, read :meth:`result`.

    Each entry is a list of tensors (one flat buffer per dtype) combined
    element by element; the right operand is handed to ``release`` once
    added, so its memory can serve the next leaf. At most ``log2(n) + 1``
    entries are alive.

    Example:
        >>> stack = TreeStack()
        >>> for leaf in bit_reversed(4):
        ...     stack.push([torch.tensor([float(leaf)])])
        >>> stack.result()[0].item()
        6.0
    """

    def __init__(self, release: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        self._entries: list[tuple[int, list[torch.Tensor]]] = []
        self._release = release

    def push(self, leaf: list[torch.Tensor], level: int = 0) -> None:
        """Add a leaf (or a summed subtree at its ``level``); merge equal levels, the earlier on the left."""
        value = leaf
        for left in self.chain(level):
            for a, b in zip(left, value, strict=True):
                a.add_(b)
            value = left
        self.settle(leaf, level)

    def chain(self, level: int) -> list[list[torch.Tensor]]:
        """The entries a leaf pushed at ``level`` merges with, the first merge first (nothing changes).

        Adding the leaf into the first, that into the second ... is what :meth:`push` does; a
        caller may make those additions piece by piece (a range of each buffer at a time), then
        call :meth:`settle`.

        Example:
            >>> stack = TreeStack()
            >>> stack.push([torch.tensor([1.0])])
            >>> [e[0].item() for e in stack.chain(0)], stack.chain(1)
            ([1.0], [])
        """
        merged: list[list[torch.Tensor]] = []
        for entry_level, entry in reversed(self._entries):
            if entry_level != level:
                break
            merged.append(entry)
            level += 1
        return merged

    def settle(self, leaf: list[torch.Tensor], level: int = 0) -> None:
        """Record a push of ``leaf`` whose additions into :meth:`chain`'s entries were already made.

        Example:
            >>> stack = TreeStack()
            >>> stack.push([torch.tensor([1.0])])
            >>> leaf = [torch.tensor([2.0])]
            >>> for left in stack.chain(0):
            ...     _ = left[0].add_(leaf[0])
            >>> stack.settle(leaf)
            >>> stack.result()[0].item()
            3.0
        """
        value = leaf
        while self._entries and self._entries[-1][0] == level:
            _, left = self._entries.pop()
            if self._release is not None:
                self._release(value)
            level, value = level + 1, left
        self._entries.append((level, value))

    def result(self) -> list[torch.Tensor]:
        """The sum of every leaf pushed; raises ValueError unless their count was a power of two."""
        if len(self._entries) != 1:
            msg = f"a tree needs a power-of-two count of leaves; {len(self._entries)} partial sums remain"
            raise ValueError(msg)
        return self._entries[0][1]


class Round(NamedTuple):
    """One step of a rank's exchange: send ``give`` to ``partner``, receive into ``take`` (and add it)."""

    partner: int
    give: tuple[int, int]
    take: tuple[int, int]
    add: bool


def plan(rank: int, world: int, numel: int) -> list[Round]:
    """The rounds rank ``rank`` of ``world`` runs to combine a buffer of ``numel`` elements. Pure.

    Partners are ``rank ^ world/2``, then ``^ world/4`` ... ``^ 1``: the upper
    levels of :func:`tree_sum`'s tree over the ranks' nodes. A buffer of at
    least ``world`` elements is halved each round (each rank keeps the half
    its bit says and adds the partner's copy of it), then the summed pieces
    are sent back up the same pairs, unchanged; a smaller one is sent whole
    and added each round.

    Example:
        >>> [tuple(r) for r in plan(0, 2, 4)]
        [(1, (2, 4), (0, 2), True), (1, (0, 2), (2, 4), False)]
    """
    rounds: list[Round] = []
    bit = world // 2
    if numel < world:
        while bit:
            rounds.append(Round(rank ^ bit, (0, numel), (0, numel), True))
            bit //= 2
        return rounds
    start, end = 0, numel
    halves: list[Round] = []
    while bit:
        mid = (start + end) // 2
        keep, give = ((start, mid), (mid, end)) if not rank & bit else ((mid, end), (start, mid))
        halves.append(Round(rank ^ bit, give, keep, True))
        start, end = keep
        bit //= 2
    gathers = [Round(r.partner, r.take, r.give, False) for r in reversed(halves)]
    return halves + gathers


def simulate_exchange(nodes: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """What :func:`exchange` leaves on each rank, given each rank's buffers, computed in one process. Pure.

    Example:
        >>> out = simulate_exchange([[torch.tensor([1.0, 2.0])], [torch.tensor([10.0, 20.0])]])
        >>> [o[0].tolist() for o in out]
        [[11.0, 22.0], [11.0, 22.0]]
    """
    world = len(nodes)
    held = [[b.clone() for b in node] for node in nodes]
    plans = [[plan(rank, world, b.numel()) for b in held[rank]] for rank in range(world)]
    count = max((len(p) for p in plans[0]), default=0)
    for step in range(count):
        sent = [
            [
                held[rank][i][slice(*p[step].give)].clone() if step < len(p) else None
                for i, p in enumerate(plans[rank])
            ]
            for rank in range(world)
        ]
        for rank in range(world):
            for i, p in enumerate(plans[rank]):
                incoming = sent[p[step].partner][i] if step < len(p) else None
                if incoming is None:  # a small buffer's rounds are over
                    continue
                target = held[rank][i][slice(*p[step].take)]
                target.add_(incoming) if p[step].add else target.copy_(incoming)
    return held


def scratch_for(buffers: Sequence[torch.Tensor], world: int) -> list[torch.Tensor]:
    """Space for what :func:`exchange` receives before adding it: half of each buffer (all of a small one).

    Made once and passed to every exchange, the received halves land in pages
    already mapped rather than in a fresh allocation every round.

    Example:
        >>> [s.numel() for s in scratch_for([torch.zeros(11), torch.zeros(3)], world=4)]
        [6, 3]
    """
    sizes = [b.numel() if b.numel() < world else (b.numel() + 1) // 2 for b in buffers]
    return [torch.empty(n, dtype=b.dtype, device=b.device) for n, b in zip(sizes, buffers, strict=True)]


# Elements per message of the exchange: a round's piece is sent in chunks of this many, and each
# received chunk is added while the next ones are still on the wire.
CHUNK = 1 << 18


def _chunks(span: tuple[int, int], chunk: int) -> list[tuple[int, int]]:
    """``span`` cut at multiples of ``chunk`` from its start (both partners cut a piece alike)."""
    start, end = span
    return [(i, min(i + chunk, end)) for i in range(start, end, chunk)] or [span]


def exchange(
    buffers: list[torch.Tensor],
    rank: int,
    world: int,
    group: Any = None,
    scratch: list[torch.Tensor] | None = None,
    chunk: int = CHUNK,
) -> None:
    """Combine every rank's ``buffers`` in place along :func:`plan`, over point-to-point messages.

    All messages of a round are posted at once (``batch_isend_irecv``, one tag
    each): every buffer's piece in chunks of ``chunk`` elements, the same cuts
    on both partners. Received chunks land in ``scratch`` (:func:`scratch_for`;
    made here when not given) and each is added as soon as it has arrived, in
    order, while the later ones travel. The cuts change no bit: every element
    is added to its partner's copy in the pairs and order :func:`plan` says.
    :class:`Exchange` is the same, with a first round that may start early.
    """
    Exchange(buffers, rank, world, group, scratch, chunk).finish()


class _Posted(NamedTuple):
    """The messages of one round posted for some buffers, and the additions waiting on them."""

    requests: list[Any]
    adds: list[tuple[int, torch.Tensor, torch.Tensor]]  # (index of the recv op, target, received)
    small: set[int]  # receives into a buffer sent whole in the same round


class Exchange:
    """:func:`exchange` in two parts: the first round of each buffer posted as soon as it is final.

    ``start(indices)`` posts the first round's messages of those buffers (their
    values must not change any more) and returns; ``finish()`` posts the other
    buffers' first round, adds what arrived, and runs the later rounds for all.
    Exact mode starts a bucket of parameters during the step's last backward,
    as soon as its gradients are summed, so its first round travels while the
    backward goes on. Each element is added in the same pairs as by
    :func:`exchange` (the buffers' plans and tags do not depend on when a round
    is posted), so the bits are the same.

    Example:
        >>> solo = Exchange([torch.ones(3)], rank=0, world=1)   # one rank: nothing to send
        >>> solo.start([0]); solo.finish(); solo.buffers[0].tolist()
        [1.0, 1.0, 1.0]
    """

    def __init__(
        self,
        buffers: list[torch.Tensor],
        rank: int,
        world: int,
        group: Any = None,
        scratch: list[torch.Tensor] | None = None,
        chunk: int = CHUNK,
    ) -> None:
        self.buffers = buffers
        self.group = group
        self.chunk = chunk
        self.plans = [plan(rank, world, b.numel()) for b in buffers]
        self.scratch = scratch_for(buffers, world) if scratch is None else scratch
        self._posted: dict[int, _Posted] = {}  # each started buffer's round in flight

    def start(self, indices: list[int]) -> None:
        """Post the first round of ``buffers[i]`` for each ``i`` in ``indices`` (not started before)."""
        for i in indices:
            if i not in self._posted:
                self._posted[i] = self._post(0, [i])

    @property
    def started(self) -> set[int]:
        """The buffers whose first round is posted."""
        return set(self._posted)

    def finish(self) -> None:
        """Post the rest of the first round, then add every arrival and post the buffer's next round.

        Round by round, buffer by buffer in index order on every rank (whatever order the buffers
        started in): a rank waits only on a round its partner posts before its own next wait, so
        none waits for ever; a buffer's next round travels while the others' arrivals are added.
        """
        for i in range(len(self.buffers)):
            self.start([i])
        for step in range(max((len(p) for p in self.plans), default=0)):
            for i, p in enumerate(self.plans):
                if step < len(p):
                    self._complete(self._posted[i])  # every message of the round, sends included
                    if step + 1 < len(p):
                        self._posted[i] = self._post(step + 1, [i])
        self._posted = {}

    def _post(self, step: int, indices: list[int]) -> _Posted:
        import torch.distributed as tdist

        ops = []
        adds: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        small: set[int] = set()
        count = len(self.buffers)
        for i in indices:
            buffer, p, space = self.buffers[i], self.plans[i], self.scratch[i]
            if step >= len(p):  # a small buffer's rounds are over
                continue
            r = p[step]
            # Chunk k of buffer i travels under tag k * len(buffers) + i: the partner cuts its piece alike.
            for k, give in enumerate(_chunks(r.give, self.chunk)):
                sent = buffer[slice(*give)]
                ops.append(tdist.P2POp(tdist.isend, sent, r.partner, self.group, k * count + i))
            for k, take in enumerate(_chunks(r.take, self.chunk)):
                target = buffer[slice(*take)]
                incoming = space[take[0] - r.take[0] : take[1] - r.take[0]] if r.add else target
                if r.add:
                    adds.append((len(ops), target, incoming))
                    if r.give == r.take:
                        small.add(len(ops))
                ops.append(tdist.P2POp(tdist.irecv, incoming, r.partner, self.group, k * count + i))
        requests = tdist.batch_isend_irecv(ops) if ops else []
        return _Posted(requests, adds, small)

    @staticmethod
    def _complete(posted: _Posted) -> None:
        requests, adds, small = posted
        finished = [False] * len(requests)
        for index, target, incoming in adds:
            if index in small:  # a small buffer sends what it adds to: only once its sends are done
                continue
            requests[index].wait()  # this receive only: its send reads another half of the buffer
            finished[index] = True
            target.add_(incoming)
        for request, done in zip(requests, finished, strict=True):
            if not done:
                request.wait()
        for index, target, incoming in adds:
            if index in small:
                target.add_(incoming)
