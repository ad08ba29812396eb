"""`jobs/gpu_bench.py`: the one GPU bench. Each part is a small module here, run in its own process under its own
time limit (`budget.py` has the plan); `orchestrator.py` runs them and writes one JSON whatever fails.

Nothing on this path imports Ray or a package the GPU image lacks: that image has torch, triton, transformers,
numpy and safetensors, with the project on PYTHONPATH (not installed).
"""
