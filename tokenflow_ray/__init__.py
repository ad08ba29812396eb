"""tokenflow_ray: streaming LLM serving under bursts, and a dual-codebook image tokenizer, on Ray."""

__version__ = "0.1.0"
