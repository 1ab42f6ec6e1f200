"""Running a plan: work items, executors and backends, isolation, Slurm."""
