"""Plan before you launch: memory estimator, parallelism planner, preflight explain."""
