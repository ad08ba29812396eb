import math

import pytest
import torch

from tokenflow_ray.tokenizer.config import QuantizerConfig
from tokenflow_ray.tokenizer.quantizer import SharedIndexCodebook, chunked_argmax_dot, l2n


def _codebook(**kw) -> SharedIndexCodebook:
    cb = SharedIndexCodebook(QuantizerConfig(**{"codebook_size": 97, "search_chunk": 13, "query_chunk": 7, **kw}))
    with torch.no_grad():  # spread the codes out: the paper's tiny uniform init makes ties likely in a unit test
        cb.embed_sem_KC.normal_()
        cb.embed_pix_KC.normal_()
    return cb


@pytest.mark.parametrize("w", [0.1, 1.0, 3.0, 10.0])
def test_shared_rule_equals_nn_on_weighted_concatenation(w):
    cb = _codebook(w_dis=w)
    q_sem, q_pix = torch.randn(50, 32), torch.randn(50, 8)
    idx = cb.search(q_sem, q_pix)
    # The paper's rule, written out with full distance matrices...
    d = torch.cdist(l2n(q_sem), l2n(cb.embed_sem_KC)) ** 2 + w * torch.cdist(l2n(q_pix), l2n(cb.embed_pix_KC)) ** 2
    # ...and nearest neighbour on [n(sem); sqrt(w) n(pix)] (§1 equivalence).
    cat_q = torch.cat([l2n(q_sem), math.sqrt(w) * l2n(q_pix)], 1)
    cat_e = torch.cat([l2n(cb.embed_sem_KC), math.sqrt(w) * l2n(cb.embed_pix_KC)], 1)
    nn_idx = torch.cdist(cat_q, cat_e).argmin(1)
    assert torch.equal(idx, d.argmin(1))
    assert torch.equal(idx, nn_idx)


def test_w_extremes_reduce_to_single_branch_search():
    q_sem, q_pix = torch.randn(40, 32), torch.randn(40, 8)
    sem_only = _codebook(w_dis=0.0)
    assert torch.equal(sem_only.search(q_sem, q_pix), (l2n(q_sem) @ l2n(sem_only.embed_sem_KC).T).argmax(1))
    pix_only = _codebook(w_sem=0.0)
    assert torch.equal(pix_only.search(q_sem, q_pix), (l2n(q_pix) @ l2n(pix_only.embed_pix_KC).T).argmax(1))


def test_separate_mode_gives_two_independent_indices():
    cb = _codebook(index_mode="separate")
    q_sem, q_pix = torch.randn(30, 32), torch.randn(30, 8)
    idx = cb.search(q_sem, q_pix)
    assert idx.shape == (30, 2)
    assert torch.equal(idx[:, 0], (l2n(q_sem) @ l2n(cb.embed_sem_KC).T).argmax(1))
    assert torch.equal(idx[:, 1], (l2n(q_pix) @ l2n(cb.embed_pix_KC).T).argmax(1))
    assert cb.lookup(idx).shape == (30, 40)


@pytest.mark.parametrize("qc,sc", [(1, 1), (5, 3), (1000, 1000)])
def test_chunking_does_not_change_the_answer(qc, sc):
    q, e = torch.randn(23, 6), torch.randn(41, 6)
    assert torch.equal(chunked_argmax_dot(q, e, qc, sc), (q @ e.T).argmax(1))


def test_ties_resolve_to_lowest_index_across_chunks():
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    assert chunked_argmax_dot(torch.tensor([[1.0, 0.0]]), e, 1, 1).item() == 0


def test_usage_window_and_dead_code_restart():
    cb = SharedIndexCodebook(QuantizerConfig(codebook_size=16, sem_dim=4, pix_dim=2, usage_window=8))
    cb.record_usage(torch.tensor([0, 1, 2, 3]))
    assert cb.usage() == pytest.approx(4 / 16)
    assert cb.restart_dead_codes(torch.randn(5, 4), torch.randn(5, 2)) == 0  # window not full yet: no restart
    cb.record_usage(torch.tensor([1, 1, 1, 1, 5, 5]))  # wraps around: window now holds 2,3,1,1,1,1,5,5
    assert cb.usage() == pytest.approx(4 / 16)  # {1, 2, 3, 5}; index 0 rolled out of the window
    before_sem = cb.embed_sem_KC.detach().clone()
    z_sem, z_pix = torch.randn(5, 4), torch.randn(5, 2)
    assert cb.restart_dead_codes(z_sem, z_pix) == 12
    live = torch.tensor([1, 2, 3, 5])
    assert torch.equal(cb.embed_sem_KC[live], before_sem[live])
    dead = torch.tensor([0, 4, 6, 15])
    # restarted rows are unit-normalised copies of the given encoder outputs, paired across the two tables
    sims = l2n(cb.embed_sem_KC[dead]) @ l2n(z_sem).T
    assert torch.allclose(sims.max(1).values, torch.ones(4), atol=1e-5)
    row_of = sims.argmax(1)
    assert torch.allclose(l2n(cb.embed_pix_KC[dead]), l2n(z_pix[row_of]), atol=1e-5)


def test_bad_indices_raise():
    cb = _codebook()
    with pytest.raises(ValueError, match="codebook size"):
        cb.lookup(torch.tensor([97]))
    with pytest.raises(ValueError, match="integer"):
        cb.lookup(torch.tensor([1.0]))


@pytest.mark.parametrize("kw", [{"codebook_size": 1}, {"w_sem": 0.0, "w_dis": 0.0}, {"w_dis": -1.0},
                                {"index_mode": "both"}, {"search_chunk": 0}, {"w_dis": float("nan")}])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        QuantizerConfig(**kw)
