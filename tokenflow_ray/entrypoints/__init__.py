"""The public offline face of the engine: `LLM` (llm.py; `from tokenflow_ray import LLM, SamplingParams`) and
`tokenflow generate` (generate.py), over runner/factory.py's `build_engine`."""
