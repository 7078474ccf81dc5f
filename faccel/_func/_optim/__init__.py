"""Pure optimizers over pytrees, one module each, all speaking the protocol of ``_base``.

``_base``: the :class:`~faccel.func.Optimizer` protocol and the helpers every
optimizer shares; ``_sgd``, ``_adamw``: the two of ``torch.optim``'s that faccel
reproduces; ``_groups``: parameter groups, an optimizer made of optimizers. A
new optimizer is a new module here and a line in the public face
``faccel/func/__init__.py``; nothing else changes.
"""
