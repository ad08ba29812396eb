"""What the model and the runner both build on: the paged attention backends (torch SDPA, the compiled CPU decode
kernel, flash-attn, the Triton kernels), the CPU kernels compiled from csrc/ and the packed linear layers.

Below both: models/ and runner/ import from here, never the other way.
"""
