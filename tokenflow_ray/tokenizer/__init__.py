"""Dual-codebook image tokenizer (TokenFlow, CVPR '25): shared-index multi-scale VQ over a semantic and a pixel code.

Import submodules directly (`tokenflow_ray.tokenizer.model`, `.config`, ...); this package file stays free of torch so
that `tokenflow --help` is fast.
"""
