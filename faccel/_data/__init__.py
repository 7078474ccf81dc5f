"""Data: the prepared loader, data sharding, samplers, splits, metrics gathering."""
