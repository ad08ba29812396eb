"""`tokenflow generate`: one prompt through the engine (the public `LLM`), printed whole or streamed.

It samples by default (temperature 0.6, top-p 0.9), as chat front ends do: greedy decoding of a small model (the
embedded one has 9.7M parameters) repeats itself within a line ("the contain the contain ..."). `--temperature 0`
is greedy; `--seed` makes a sampled answer repeatable.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 0.9


def _generate(args: argparse.Namespace) -> int:
    from tokenflow_ray.engine.sampling import SamplingParams
    from tokenflow_ray.entrypoints.llm import LLM

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format)
    if args.stream:
        for out in llm.stream(args.prompt, sampling):
            sys.stdout.write(out.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        print(llm.generate(args.prompt, sampling)[0].text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt with the engine")
    p.add_argument("--model", default="embedded", help="local HF model directory, hub id, 'embedded', or a built-in "
                                                       "config (llama3-8b, qwen2-7b, qwen2.5-32b: --load-format dummy)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config, no checkpoint read (text is meaningless)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0: greedy")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.set_defaults(handler=_generate)
