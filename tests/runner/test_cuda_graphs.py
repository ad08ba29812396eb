"""The decode CUDA graphs' logic on CPU, with an eager stand-in for capture: a step of D decodes runs the
smallest captured batch >= D, gives the eager forward's hidden states for its D rows, and its padding rows touch
only the scratch block; for flash-attn's copied-in inputs and for the Triton kernels' staged ones (under the
Triton interpreter). (Capturing real graphs needs a GPU.)"""

from __future__ import annotations

import os

import pytest
import torch

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig
from tokenflow_ray.engine.plan import ScheduledChunk, StepPlan
from tokenflow_ray.layers.attention import AttentionMetadata
from tokenflow_ray.runner.cuda_graphs import CopyInInputs, DecodeGraphs, eager_capture, run_copied_in
from tokenflow_ray.runner.model_runner import TorchModelRunner

# The Triton interpreter (numpy 2.3) converts one-element arrays to indices: harmless, and not ours.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _decode_batch(d: int, bs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3 * bs, (d,), generator=g)
    width = int(max(-(-int(n) // bs) for n in lens))
    tables = (torch.randperm(31, generator=g)[:d * width] + 1).view(d, width)  # block 0 is the scratch block
    pos = lens - 1
    slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=d, decode_block_tables=tables,
                             decode_seq_lens=lens.int(), decode_mask=None, prefills=[], scale=0.25)
    return torch.randint(0, 256, (d,), generator=g), pos, meta


@pytest.mark.parametrize("d", [1, 3, 5, 8])
def test_padded_graph_step_equals_the_eager_step(tiny_llama_dir, d):
    bs = 4
    runner = TorchModelRunner(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32",
                                                             device="cpu"),
                                           cache=CacheConfig(block_size=bs, num_device_blocks=32)))
    torch.manual_seed(0)
    runner.kv.tensor.normal_()
    kv_ref = runner.kv.tensor.clone()
    ref_layers = tuple((kv_ref[i, 0], kv_ref[i, 1]) for i in range(kv_ref.shape[0]))  # layer-major on CPU
    model, backend = runner.model, runner.backend

    def forward(ids, pos, meta, kv=runner.kv.layers):
        return model(ids, pos, kv, meta, backend)

    with torch.inference_mode():
        inputs = CopyInInputs(8, max_blocks_per_seq=8, block_size=bs, scratch_block=0, device=torch.device("cpu"),
                              scale=0.25, table_dtype=torch.long)
        graphs = DecodeGraphs(forward, sizes=(2, 4, 8), static_inputs=inputs.views, capture=eager_capture)
        runner.kv.tensor.copy_(kv_ref)  # capture's warm-up wrote the scratch block only; start both from one state
        ids, pos, meta = _decode_batch(d, bs, seed=d)
        want = forward(ids, pos, meta, kv=ref_layers)
        got = run_copied_in(graphs, inputs, ids, pos, meta)
    assert graphs.padded_size(d) == next(b for b in (2, 4, 8) if b >= d)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    changed = (runner.kv.tensor != kv_ref).flatten(3).any(-1).any(0).any(0)  # [blocks, block_size]
    changed[0] = False  # the scratch block is the padding rows'
    assert not changed.any()
    assert graphs.padded_size(9) is None and run_copied_in(graphs, inputs, *_decode_batch(9, bs, seed=9)) is None


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="graph sizes"):
        DecodeGraphs(lambda *a: None, sizes=(), static_inputs=lambda b: None, capture=eager_capture)


def test_gpu_defaults_pick_a_flash_block_size_and_keep_the_pool():
    from tokenflow_ray.engine.config import FLASH_BLOCK_SIZE
    from tokenflow_ray.runner.device_defaults import gpu_cache_defaults

    base = EngineConfig(cache=CacheConfig(num_device_blocks=1024, num_host_blocks=100))
    gpu = gpu_cache_defaults(base, cuda=True, flash=True)
    assert gpu.cache.block_size == FLASH_BLOCK_SIZE
    assert gpu.cache.num_device_blocks * FLASH_BLOCK_SIZE == 1024 * 16  # same tokens on the device
    assert gpu.cache.num_host_blocks * FLASH_BLOCK_SIZE >= 100 * 16
    assert gpu_cache_defaults(base, cuda=False, flash=True) is base  # CPU: unchanged
    assert gpu_cache_defaults(base, cuda=True, flash=False) is base  # no flash-attn: SDPA at 16
    manual = EngineConfig(cache=CacheConfig(block_size=32))
    assert gpu_cache_defaults(manual, cuda=True, flash=True) is manual  # a block size set by hand stays
    sdpa = EngineConfig(model=ModelConfig(attention_backend="sdpa"))
    assert gpu_cache_defaults(sdpa, cuda=True, flash=True) is sdpa


# ---- the Triton backend's graphs: static inputs are views of the step staging buffer -------------------------
def _triton_runner(model_dir, monkeypatch, max_seqs=4, capture=eager_capture, eager=False, staged=True):
    from tokenflow_ray.engine.config import SchedulerConfig
    from tokenflow_ray.layers.triton_attention import triton_available
    from tokenflow_ray.runner.model_runner import RunnerOptions

    if not triton_available():
        if os.environ.get("CI"):
            raise RuntimeError("CI must run the Triton graph tests: install the dev extra (triton)")
        pytest.skip("triton is not installed")
    import triton.language  # noqa: F401  (imported before the interpreter is asked for: see test_triton_attention)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu", attention_backend="triton",
                          enforce_eager=eager),
        cache=CacheConfig(block_size=4, num_device_blocks=32, kv_layout="block_major"),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16))
    return TorchModelRunner(config, options=RunnerOptions(staged=staged, graph_capture=capture))


def _prefill_then_decode(d: int):
    """d streams prefilled with 2..2+d-1 tokens into out-of-order blocks (room for one more token each), then one
    decode step for all of them."""
    blocks = iter([7, 3, 12, 5, 20, 9, 1, 15, 4, 30, 2, 8])
    prefills, decodes = [], []
    for i in range(d):
        n = 2 + 3 * i
        held = tuple(next(blocks) for _ in range(-(-(n + 1) // 4)))
        prefills.append(ScheduledChunk(f"s{i}", tuple(range(10 + i, 10 + i + n)), 0, held, 0, True))
        decodes.append(ScheduledChunk(f"s{i}", (40 + i,), n, (), len(held), True))
    return StepPlan(0, prefills=tuple(prefills)), StepPlan(1, decodes=tuple(decodes))


def _graph_vs_eager(runner: TorchModelRunner, d: int) -> None:
    """A decode step of d streams through its padded graph gives the eager, unpadded step's hidden states and KV;
    the padding rows write the scratch block only."""
    scratch = runner.config.cache.num_device_blocks
    prefill, decode = _prefill_then_decode(d)
    runner.execute(prefill)
    kv_before = runner.kv.tensor.clone()  # block-major: [blocks, layers, 2, ...]
    with torch.inference_mode():
        runner.batch.apply(decode)
        step, hidden = runner._varlen_step(decode)
        got, kv_graph = hidden[:d].clone(), runner.kv.tensor.clone()
        runner.kv.tensor.copy_(kv_before)
        eager = runner.batch.inputs(decode, runner.scale)  # the same step unpadded, kernel by kernel
        want = runner.model(eager.input_ids, eager.positions, runner.kv.layers, eager.meta, runner.backend)
    assert step.input_ids.shape[0] == runner.graphs.padded_size(d) >= d
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    changed = {b for b in range(kv_before.shape[0]) if not torch.equal(kv_graph[b], kv_before[b])}
    step_blocks = {runner.batch.host_tables[runner.batch.row_of[c.stream_id]][c.start_pos // 4] for c in decode.decodes}
    assert changed <= step_blocks | {scratch} and step_blocks <= changed  # padding rows: the scratch block only
    torch.testing.assert_close(kv_graph[:scratch], runner.kv.tensor[:scratch], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [1, 3, 4])
def test_triton_decode_graph_equals_eager(tiny_llama_dir, monkeypatch, d):
    runner = _triton_runner(tiny_llama_dir, monkeypatch)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4]
    replays = sum(g.replays for g, _ in runner.graphs._graphs.values())
    _graph_vs_eager(runner, d)
    assert sum(g.replays for g, _ in runner.graphs._graphs.values()) == replays + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [1, 3, 4])
def test_triton_decode_graph_equals_eager_on_cuda(tiny_llama_dir, d):
    """Real capture and replay (after the warm-up steps), fp32: identical to the eager step."""
    from tokenflow_ray.engine.config import SchedulerConfig

    runner = TorchModelRunner(EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cuda", attention_backend="triton"),
        cache=CacheConfig(block_size=4, num_device_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)))
    assert runner.graphs is not None and runner.batch.staging is not None and runner.kv.block_major
    _graph_vs_eager(runner, d)


def test_triton_graphs_are_captured_again_when_the_tables_grow(tiny_llama_dir, monkeypatch):
    """Ten streams at once outgrow the 10-row tables of max_num_seqs 2 (row 0 is the padding row): the tables are
    replaced, and a graph still reading the old ones would give wrong tokens for streams in the new rows."""
    graphed = _triton_runner(tiny_llama_dir, monkeypatch, max_seqs=2)
    plain = _triton_runner(tiny_llama_dir, monkeypatch, max_seqs=2, capture=None, staged=False)
    assert plain.graphs is None and plain.batch.staging is None
    first = graphed.graphs
    wide = StepPlan(0, decodes=tuple(ScheduledChunk(f"s{i}", (20 + i,), 0, (i + 1,), 0, True) for i in range(10)))
    pair = StepPlan(1, decodes=tuple(ScheduledChunk(f"s{i}", (50 + i,), 1, (), 1, True) for i in (8, 9)))
    for plan in (wide, pair):
        assert graphed.execute(plan).sampled == plain.execute(plan).sampled
    assert graphed.batch.tables_version == 1 and graphed.graphs is not first
    assert max(graphed.batch.row_of[s] for s in ("s8", "s9")) >= 10  # rows only the grown tables have
    assert sum(g.replays for g, _ in graphed.graphs._graphs.values()) == 1


def test_failed_capture_is_logged_once_and_runs_eager(tiny_llama_dir, monkeypatch, caplog):
    def broken(fn, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    with caplog.at_level("WARNING"):
        runner = _triton_runner(tiny_llama_dir, monkeypatch, capture=broken)
    assert runner.graphs is None
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records
                                                          if "capture failed" in r.message)) == 1
    _, decode = _prefill_then_decode(2)
    runner.execute(_prefill_then_decode(2)[0])
    assert set(runner.execute(decode).sampled) == {"s0", "s1"}
    assert _triton_runner(tiny_llama_dir, monkeypatch, eager=True).graphs is None  # enforce_eager: no graphs
