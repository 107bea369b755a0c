"""What the benchmarks share: the launcher helper and the one step-timing harness."""
