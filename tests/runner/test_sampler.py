"""sample(): every row's argmax, then only the rows given as sampling rows redrawn with their own generators."""

import torch

from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.runner.sampler import sample


def _logits(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))


def test_all_greedy_is_one_argmax():
    logits = _logits()
    assert sample(logits) == logits.argmax(dim=-1).tolist()


def test_sampling_rows_use_their_generator_and_leave_the_rest_greedy():
    logits = _logits()
    hot = SamplingParams(temperature=1.0)
    draw = [sample(logits, [(2, hot, torch.Generator().manual_seed(seed))])[2] for seed in range(40)]
    again = [sample(logits, [(2, hot, torch.Generator().manual_seed(seed))])[2] for seed in range(40)]
    assert draw == again  # a seeded generator decides the draw
    assert len(set(draw)) > 1  # and it is a draw, not the argmax
    out = sample(logits, [(2, hot, torch.Generator().manual_seed(1))])
    greedy = logits.argmax(dim=-1).tolist()
    assert [out[i] for i in (0, 1, 3)] == [greedy[i] for i in (0, 1, 3)]


def test_top_k_one_is_the_argmax():
    logits = _logits()
    out = sample(logits, [(r, SamplingParams(temperature=0.7, top_k=1), torch.Generator().manual_seed(r))
                          for r in range(4)])
    assert out == logits.argmax(dim=-1).tolist()
