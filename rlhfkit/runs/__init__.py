"""Services of a run's output folders, below the CLI: one run per folder (directory.py: the lock,
earlier runs and what is set aside or removed for them, the default checkpoint folder), claimed by
rlhfkit.cli.run_dir's `training_run` around every trainer's `run()`."""

from rlhfkit.runs.directory import RunDirectory

__all__ = ["RunDirectory"]
