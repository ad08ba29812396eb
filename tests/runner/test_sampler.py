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


def test_on_device_sampling_draws_the_same_tokens_without_reading_the_device():
    """The CUDA path's sampler: the same tokens as `sample` from the same generators (top-k and top-p masks
    included), and none of the ops that make the host wait for the device (.item(), boolean indexing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tokenflow_ray.runner.sampler import sample_on_device

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    logits = _logits(rows=5, vocab=300)
    params = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.3, top_k=20, top_p=0.95)]
    for seed in range(20):
        rows = [(1, params[0], torch.Generator().manual_seed(seed)), (3, params[1], torch.Generator().manual_seed(7))]
        want = sample(logits, [(r, p, torch.Generator().manual_seed(seed if r == 1 else 7)) for r, p, _ in rows])
        with Recorder() as rec:
            got = sample_on_device(logits, rows)
        assert got.tolist() == want
        assert not {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"} \
            & set(rec.ops)
