"""The lab: benchmarks (`tokenflow bench ...`), the demo (`tokenflow demo`) and the GPU bench (jobs/gpu_bench.py).

It measures the product and nothing in the product imports it: it sits at the top of the layering
(tests/test_layering.py).
"""
