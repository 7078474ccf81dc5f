"""Reporting: logging, progress bars, experiment trackers."""
