"""vLLM's offline decode tok/s, measured the way `tokenflow bench engine` measures ours. Runs INSIDE the vLLM venv.

    <vllm-venv>/bin/python vllm_offline.py --json-in SPEC.json --json-out RESULT.json

Standalone on purpose: the vLLM venv does not have tokenflow_ray, so the prompts (token ids), lengths and engine
settings come in as JSON (see vllm_engine.py, which writes it). Decode tok/s = B·(N−1) / (time(N) − time(1)),
medians over repeats, full and first runs taking turns; the mixed workload is useful tokens / median wall time.
The __main__ guard is required: vLLM's engine core starts worker processes that re-import this module.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _generate(llm, sampling_cls, prompts: list[list[int]], lengths: list[int]) -> float:
    params = [sampling_cls(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != list(lengths):  # a fixed-length comparison is only fair if vLLM really produced every token
        raise RuntimeError(f"vLLM produced {sum(got)} tokens, expected {sum(lengths)}")
    return elapsed


def run(spec: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=False,  # repeats reuse prompts; our engine has no prefix cache either
              seed=spec.get("seed", 0))
    init_s = time.perf_counter() - start
    n, repeats = spec["new_tokens"], spec["repeats"]
    results = {}
    for batch, prompts in spec["batches"].items():
        b = len(prompts)
        _generate(llm, SamplingParams, prompts, [2] * b)  # warm-up
        full, first = [], []
        for _ in range(repeats):
            full.append(_generate(llm, SamplingParams, prompts, [n] * b))
            first.append(_generate(llm, SamplingParams, prompts, [1] * b))
        tok_s = b * (n - 1) / max(statistics.median(full) - statistics.median(first), 1e-9)
        results[batch] = {"vllm_tok_s": tok_s, "full_s": full, "first_s": first}
        print(f"vLLM batch {batch:>3}: {tok_s:8.0f} tok/s", flush=True)
    out = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "init_s": init_s,
           "results": results}
    mixed = spec.get("mixed")
    if mixed:
        # Warm-up on the same shapes: a prefill step larger than the batches' may compile a new graph (vLLM CPU
        # compiles per token-count range), which must not land in the timed runs.
        _generate(llm, SamplingParams, mixed["prompts"], [2] * len(mixed["prompts"]))
        times = [_generate(llm, SamplingParams, mixed["prompts"], mixed["lengths"]) for _ in range(repeats)]
        out["mixed_vllm_tok_s"] = sum(mixed["lengths"]) / statistics.median(times)
        out["mixed_s"] = times
        print(f"vLLM mixed: {out['mixed_vllm_tok_s']:.0f} tok/s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-in", required=True)
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args()
    with open(args.json_in) as fh:
        spec = json.load(fh)
    out = run(spec)
    with open(args.json_out, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
