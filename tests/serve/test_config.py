"""ServeConfig, the Serve YAML, the CLI wiring and cluster.yaml (no Ray instance needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tokenflow_ray.serve.config import ServeConfig, serve_engine
from tokenflow_ray.serve.http.protocol import APIError, CompletionRequest, ConsumptionReport, parse_body

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def test_config_validates_and_builds_engine_config():
    cfg = ServeConfig(default_rate=4, engine=serve_engine(policy="fcfs", num_device_blocks=64,
                                                          num_host_blocks=32, max_num_seqs=8))
    ec = cfg.engine_config()
    assert (ec.cache.num_device_blocks, ec.cache.num_host_blocks, ec.scheduler.max_num_seqs) == (64, 32, 8)
    assert ec.scheduler.policy == "fcfs" and cfg.default_rate == 4
    for bad in ({"policy": "nope"}, {"replicas": 0}, {"default_rate": -1}, {"max_body_bytes": 10},
                {"api_key": ""}, {"num_device_blocks": 0}, {"pin_cpus": -1}, {"pin_cpus": 1.5}, {"pin_cpus": True}):
        with pytest.raises(ValueError):
            ServeConfig.from_dict(bad)  # engine options (policy, num_device_blocks) flat, as old files have them
    with pytest.raises(ValueError, match="unknown ServeConfig keys"):
        ServeConfig.from_dict({"modle": "x"})


def test_load_format_reaches_the_engine_config():
    dummy = ServeConfig(engine=serve_engine(model="llama3-8b", load_format="dummy"))
    assert dummy.engine_config().model.load_format == "dummy"
    with pytest.raises(ValueError, match="load_format='dummy'"):
        ServeConfig(engine=serve_engine(model="llama3-8b"))  # a built-in config has no weights to serve
    with pytest.raises(ValueError, match="load_format"):
        ServeConfig(engine=serve_engine(load_format="random"))


def test_a_mixed_fleet_sizes_each_ranks_device_pool(tmp_path):
    """device_blocks_by_rank: rank i's engine gets entry i's device pool, ranks past the list the default; the rest
    of the config, admission included, is the fleet's."""
    cfg = ServeConfig(replicas=3, device_blocks_by_rank=[384, 128],
                      engine=serve_engine(num_device_blocks=256))
    assert cfg.device_blocks_by_rank == (384, 128)  # a YAML list becomes the frozen tuple
    pools = [cfg.engine_config(rank).cache.num_device_blocks for rank in (0, 1, 2)]
    assert pools == [384, 128, 256] and cfg.engine_config().cache.num_device_blocks == 256
    assert cfg.engine_config(1).scheduler == cfg.engine_config().scheduler
    assert cfg.admission() == ServeConfig(replicas=3, engine=serve_engine(num_device_blocks=256)).admission()
    for bad in ([0], [128, -1], [1.5], [True], "384,128", 384):
        with pytest.raises(ValueError, match="device_blocks_by_rank"):
            ServeConfig(device_blocks_by_rank=bad)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"replicas": 2, "device_blocks_by_rank": [512, 64]}))
    assert ServeConfig.from_yaml(path).engine_config(1).cache.num_device_blocks == 64


def test_the_engine_is_one_nested_config_with_the_servers_defaults():
    """ServeConfig declares no engine field of its own: the engine's, with the server's defaults over them."""
    from dataclasses import fields

    from tokenflow_ray.engine.config import EngineConfig, engine_option_names

    assert not {f.name for f in fields(ServeConfig)} & engine_option_names()
    ec = ServeConfig().engine
    assert (ec.scheduler.policy, ec.cache.num_host_blocks) == ("tokenflow", 4096)  # the server's defaults
    assert ec.cache.num_device_blocks == EngineConfig().cache.num_device_blocks  # the rest is the engine's
    assert ServeConfig(engine=serve_engine(policy="fcfs")).engine.cache.num_host_blocks == 4096
    with pytest.raises(ValueError, match="engine: must be an EngineConfig"):
        ServeConfig(engine={"policy": "fcfs"})


def test_yaml_engine_options_nested_or_flat_as_before(tmp_path):
    """`engine:` takes engine options (or parts); flat ones, as files had them before the nesting, still read."""
    nested, flat = tmp_path / "nested.yaml", tmp_path / "flat.yaml"
    nested.write_text(yaml.safe_dump({"replicas": 2, "engine": {"policy": "fcfs", "num_device_blocks": 256,
                                                                 "cache": {"num_host_blocks": 8}}}))
    flat.write_text(yaml.safe_dump({"replicas": 2, "policy": "fcfs", "num_device_blocks": 256, "num_host_blocks": 8}))
    a, b = ServeConfig.from_yaml(nested), ServeConfig.from_yaml(flat)
    assert a == b and a.replicas == 2
    assert (a.engine.scheduler.policy, a.engine.cache.num_device_blocks, a.engine.cache.num_host_blocks) == (
        "fcfs", 256, 8)
    # Overrides (the CLI's flags) win over the file, an engine option's too.
    over = ServeConfig.from_yaml(nested, policy="andes", replicas=3, model=None)
    assert (over.engine.scheduler.policy, over.replicas) == ("andes", 3)
    with pytest.raises(ValueError, match="policy: given both flat and under engine:"):
        ServeConfig.from_dict({"policy": "fcfs", "engine": {"policy": "andes"}})
    with pytest.raises(ValueError, match="unknown ServeConfig keys: \\['modle'\\]"):
        ServeConfig.from_dict({"engine": {"model": "embedded"}, "modle": "x"})
    with pytest.raises(ValueError, match="unknown engine option 'modle'"):
        ServeConfig.from_dict({"engine": {"modle": "x"}})


def test_device_defaults_are_resolved_once_before_admission_reads_them(monkeypatch):
    """Replicas given a GPU (num_gpus > 0) run on CUDA: the config resolves the engine's device defaults when it is
    built, so admission and every replica read the same block size and pool (the replica's factory, resolving
    again, changes nothing)."""
    import tokenflow_ray.serve.config as serve_config
    from tokenflow_ray.engine.config import FLASH_BLOCK_SIZE
    from tokenflow_ray.runner.device_defaults import DeviceFacts, resolve_device_defaults

    cpu = ServeConfig(images=False)
    assert cpu.engine.overlap_scheduling is False and cpu.engine.cache.block_size == 16
    assert serve_config.replica_device_facts("auto", 0) == DeviceFacts(cuda=False, flash_attn=False)
    assert serve_config.replica_device_facts("auto", 1).cuda and serve_config.replica_device_facts("cuda:1", 0).cuda
    monkeypatch.setattr(serve_config, "replica_device_facts", lambda device, gpus: DeviceFacts(gpus > 0, gpus > 0))
    gpu = ServeConfig(images=False, num_gpus=1, engine=serve_engine(num_device_blocks=1024, num_host_blocks=4096))
    cache = gpu.engine.cache
    assert (cache.block_size, cache.num_device_blocks, cache.num_host_blocks) == (FLASH_BLOCK_SIZE, 64, 256)
    assert gpu.engine.overlap_scheduling is True and gpu.engine_config(0) == gpu.engine
    assert resolve_device_defaults(gpu.engine, DeviceFacts(True, True)) == gpu.engine
    # Admission counts in the resolved blocks: 512 expected tokens are 2 blocks of 256, (64 + 256) // 2 streams.
    assert gpu.admission().max_ongoing_requests == (64 + 256) // 2


def test_serve_yaml_is_the_cli_config(tmp_path):
    cfg = ServeConfig.from_yaml(ROOT / "tokenflow_ray/serve/serve.yaml")
    assert cfg.app_name == "tokenflow" and cfg.engine.scheduler.policy == "tokenflow"
    assert cfg.engine.cache.num_host_blocks == 2048
    doc = yaml.safe_load((ROOT / "tokenflow_ray/serve/serve.yaml").read_text())
    assert doc["applications"][0]["import_path"] == "tokenflow_ray.serve.app:app_builder"
    assert ServeConfig.from_yaml(ROOT / "tokenflow_ray/serve/serve.yaml", port=9001, replicas=2).port == 9001


def test_app_builder_builds_an_application():
    from ray.serve import Application

    from tokenflow_ray.serve.app import app_builder

    assert isinstance(app_builder({"policy": "fcfs", "images": False}), Application)
    from tokenflow_ray.serve.config import images_available

    if images_available():  # the image tokenizer's routes and deployment are bound by default once they exist
        assert ServeConfig().images is True
        assert isinstance(app_builder({"policy": "fcfs"}), Application)


def test_protocol_rejects_bad_values():
    ok = parse_body(b'{"model": "m", "prompt": ["one"], "consumption_rate": 2}', CompletionRequest)
    assert ok.prompt == "one" and ok.consumption_rate == 2.0
    for raw in (b'{"model": "m", "prompt": "x", "consumption_rate": NaN}', b'{"model": "m"}', b"nope",
                b'{"model": "m", "prompt": "x", "top_p": 0}'):
        with pytest.raises(APIError) as err:
            parse_body(raw, CompletionRequest)
        assert err.value.status == 400
    assert parse_body(b'{"rate": 3}', ConsumptionReport).rate == 3.0
    with pytest.raises(APIError):
        parse_body(b'{"paused": 1}', ConsumptionReport)


def test_cli_registers_serve_demo_and_bench_serve():
    from tokenflow_ray.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "embedded", "--replicas", "2", "--policy", "fcfs"])
    assert args.replicas == 2 and args.policy == "fcfs"
    assert parser.parse_args(["demo", "--policies", "fcfs", "--streams", "4"]).streams == 4
    assert parser.parse_args(["bench", "serve", "--json", "x.json"]).streams == 32


def test_demo_workload_contends_for_memory_within_decode_capacity():
    from tokenflow_ray.lab.demo import DemoConfig

    cfg = DemoConfig()
    cache = cfg.serve_config("fcfs").engine.cache
    full_blocks = -(-(len(cfg.prompt(0)) + 2 + cfg.max_tokens) // cache.block_size)
    assert cache.num_device_blocks < cfg.streams * full_blocks  # only a fraction fits at full length
    # Σ rates near but under the replica's decode rate over HTTP on a 2-core box (`tokenflow bench serve`, 32
    # streams: ~1.4k tok/s at 7984f35; 2312 in the run on record,
    # docs/results/runs/serve_http_vs_inproc_256tok.json): the contest is over who runs when, not raw capacity.
    assert 500 < cfg.streams * cfg.rate < 1000


def test_load_generator_refuses_non_loopback():
    import asyncio

    from tokenflow_ray.client import StreamSpec, run_load

    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(run_load("http://example.com", [StreamSpec("x")]))


def test_cluster_yaml_validates():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    assert types["head"]["resources"] == {"CPU": 0} and types["gpu_worker"]["max_workers"] >= 1


def test_prefix_caching_is_on_by_default_and_off_by_a_flag(monkeypatch):
    """The serve default reuses cached prefixes on both tiers; `tokenflow serve --no-prefix-caching` turns it off
    (the config reaches run_server as the CLI built it)."""
    import tokenflow_ray.serve.lifecycle as lifecycle
    from tokenflow_ray.cli import build_parser

    assert serve_engine().cache.prefix_cache_mode == "device+host"
    seen = []
    monkeypatch.setattr(lifecycle, "run_server", lambda config: seen.append(config) or 0)
    for argv, mode in ((["serve"], "device+host"), (["serve", "--no-prefix-caching"], "off")):
        args = build_parser().parse_args(argv)
        assert args.handler(args) == 0
        assert seen[-1].engine.cache.prefix_cache_mode == mode
