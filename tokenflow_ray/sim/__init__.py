"""Discrete-event simulator: the engine's own scheduler, policies, block pool and host-store accounting, and the
cluster's routing decision, with only the model runner replaced by a cost model on a virtual clock.

Pure Python (no torch, no ray). See docs/results/simulator.md and docs/design.md §9.
"""
