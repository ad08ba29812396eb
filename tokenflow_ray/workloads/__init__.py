"""What the benchmarks and the simulator feed the engine: seeded request workloads (`generators`) and the paper's
experiment arms (`ablations`). Pure Python, below both."""
