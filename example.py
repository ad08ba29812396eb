"""The engine in a few lines: `python example.py` (the embedded model that ships with the package, CPU or GPU).

`tokenflow serve` puts the same engine behind an OpenAI-compatible HTTP API; `tokenflow demo` compares its
scheduling policies under a burst of paced readers.
"""

from tokenflow_ray import LLM, SamplingParams

prompts = ["The module", "Return a new list"]
llm = LLM(model="embedded", dtype="float32")
sampling = SamplingParams(max_tokens=32, temperature=0.6, top_p=0.9, seed=0)
for prompt, result in zip(prompts, llm.generate(prompts, sampling)):
    print(f"{prompt!r} -> {prompt + result.text!r} ({len(result.token_ids)} tokens, {result.finish_reason})")
