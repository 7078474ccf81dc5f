"""Exact mode's room: atoms at every size (``_mode``) summed in one fixed tree (``_tree_reduce``)."""
