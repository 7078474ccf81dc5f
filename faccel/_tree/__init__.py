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

# Re-exported by name (`x as x`); each module's own __all__ is the list.
from faccel._tree._containers import (
    MISSING as MISSING,
)
from faccel._tree._containers import (
    children as children,
)
from faccel._tree._containers import (
    flatten_with_paths as flatten_with_paths,
)
from faccel._tree._containers import (
    map_tensors as map_tensors,
)
from faccel._tree._containers import (
    paired_leaves as paired_leaves,
)
from faccel._tree._containers import (
    rebuild as rebuild,
)
from faccel._tree._containers import (
    to_plain as to_plain,
)
from faccel._tree._pytree import (
    TreeSpec as TreeSpec,
)
from faccel._tree._pytree import (
    flatten as flatten,
)
from faccel._tree._pytree import (
    keystr as keystr,
)
from faccel._tree._pytree import (
    register_pytree as register_pytree,
)
from faccel._tree._pytree import (
    same_structure as same_structure,
)
from faccel._tree._pytree import (
    static_field as static_field,
)
from faccel._tree._pytree import (
    tree_flatten as tree_flatten,
)
from faccel._tree._pytree import (
    tree_flatten_with_path as tree_flatten_with_path,
)
from faccel._tree._pytree import (
    tree_leaves as tree_leaves,
)
from faccel._tree._pytree import (
    tree_map as tree_map,
)
from faccel._tree._pytree import (
    tree_unflatten as tree_unflatten,
)
from faccel._tree._pytree import (
    unflatten as unflatten,
)
