"""The run's shell: from a composed config to a finished run directory (checks, the run directory
and its lock, stop signals, building the parts, the records a run leaves)."""
