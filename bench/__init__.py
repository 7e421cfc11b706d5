"""The benchmark harness behind `make bench`: trainyard measured side by side with its baselines.

Nothing in the product imports this package, and it never runs in CI (its numbers depend on the machine).
`python -m bench.run` runs every registered section and writes `bench/results.json`; see BENCHMARKS.md.
"""
