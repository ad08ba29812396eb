"""The §6 "Tier B" CPU experiment: colourised sklearn digits, a colour-invariant teacher CNN, and tokenizer arms
P / S / TF / TF-sep plus a w sweep at equal K, scored by reconstruction, probes and codebook statistics.
Entry point: `run.run_experiment(ExperimentConfig)`; the CLI is `tokenflow tokenizer experiment`.
"""
