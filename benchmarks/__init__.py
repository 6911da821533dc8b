"""gflow's benchmark suite: `python -m benchmarks run [--quick]`."""
