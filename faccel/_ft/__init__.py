"""Fault-tolerant data parallelism: replica groups that come and go between steps.

See docs/fault-tolerance.md.
"""
