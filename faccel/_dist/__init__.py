"""The run's processes: launch environment, DistState, layout, process group, mesh, collectives."""
