"""Benchmarks. Each script runs from the repository root (`python bench/rollout.py ...`, GPU runs through the
bench/run_*.sh scripts) and prints a JSON line; results are kept under bench/results. What the scripts share is
the package bench.harness; a script imports no other script."""
