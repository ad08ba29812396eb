"""The public face: `from tokenflow_ray import LLM, SamplingParams`, engine options by name, results with text."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenflow_ray import LLM, SamplingParams

SMALL = dict(dtype="float32", device="cpu", fused_cpu_ops=False, cpu_prepack=False, max_num_seqs=4,
             num_device_blocks=64)


def test_import_is_torch_free_and_lazy():
    """`import tokenflow_ray` loads no torch; the names load on first use; an unknown one is an AttributeError."""
    code = ("import sys, tokenflow_ray as t\n"
            "assert 'torch' not in sys.modules\n"
            "assert 'LLM' in dir(t) and t.SamplingParams(max_tokens=2).max_tokens == 2\n"
            "assert 'torch' not in sys.modules\n"
            "try:\n    t.nope\nexcept AttributeError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_generate_and_stream_give_the_same_greedy_text():
    llm = LLM(model="embedded", **SMALL)
    assert llm.engine.config.scheduler.max_num_seqs == 4 and llm.engine.config.cache.num_device_blocks == 64
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    results = llm.generate(["The module", "Return"], sampling)
    assert [len(r.token_ids) for r in results] == [12, 12] and all(r.finish_reason == "length" for r in results)
    assert all(r.text for r in results)
    streamed = list(llm.stream("The module", sampling))
    assert "".join(o.text for o in streamed) == results[0].text
    assert llm.generate("The module", sampling)[0].token_ids == results[0].token_ids  # one prompt as a string


def test_an_unknown_option_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match="unknown engine option 'max_seqs'"):
        LLM(model="embedded", max_seqs=4)
