"""Side-by-side benchmarks of faccel, plain PyTorch, Accelerate and Lightning Fabric.

Run them with ``python benchmarks/run.py [--quick] [--only NAME ...]``; see README.md here.
"""
