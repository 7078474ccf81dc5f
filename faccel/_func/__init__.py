"""Functional training (torch.func): calls, gradient sync, pure optimizers."""
