"""Trees: every walk over nested containers in faccel goes through this package.

Two kinds of tree, one module each:

- ``_containers``: user data (batches, model outputs, trees given to
  collectives and metrics, checkpoint extras) as nests of tuples, lists,
  named tuples, mappings and attrs records. Flatten with paths, rebuild, map
  over tensors, walk two trees together, turn into JSON's types.
- ``_pytree``: ``torch.func`` trees (parameters, gradients, optimizer states)
  through PyTorch's own pytree registry, which the transforms use; records are
  registered with :func:`register_pytree`.

Other modules import from ``faccel._tree`` only, never from the two modules or
from ``torch.utils._pytree``.
"""

from faccel._tree._containers import (
    MISSING,
    children,
    flatten_with_paths,
    map_tensors,
    paired_leaves,
    rebuild,
    to_plain,
)
from faccel._tree._pytree import (
    TreeSpec,
    flatten,
    keystr,
    register_pytree,
    same_structure,
    static_field,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
    unflatten,
)

__all__ = [
    "MISSING",
    "TreeSpec",
    "children",
    "flatten",
    "flatten_with_paths",
    "keystr",
    "map_tensors",
    "paired_leaves",
    "rebuild",
    "register_pytree",
    "same_structure",
    "static_field",
    "to_plain",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unflatten",
]
