"""`tokenflow bench migration`'s downtime part on the real embedded model (the hot-replica part needs Serve and
runs in the benchmark only; tests/serve/test_migration_http.py covers the served move)."""

from tokenflow_ray.lab.migration_bench import MigrationBenchConfig, burst, measure_downtime


def test_downtime_moves_carry_kv_and_recompute_moves_do_not():
    cfg = MigrationBenchConfig(contexts=(24, 80), moves=2)
    out = measure_downtime(cfg, progress=lambda _: None)
    assert len(out["moves"]) == 4 and set(out["by_context"]) == {"24", "80"}
    for move in out["moves"]:
        # The KV of every token but the last sampled one moved (write-through mirrored it, the tail went at pause).
        assert move["kv_tokens"] == move["tokens"] - 1 >= move["context"]
        assert move["downtime_ms"] > 0 and move["recompute_ms"] > 0
    assert set(out["downtime_ms"]) == set(out["recompute_ms"]) == {"p50", "p99"}


def test_the_hot_burst_is_seeded_and_uneven():
    cfg = MigrationBenchConfig()
    a, b = burst(cfg), burst(cfg)
    assert a == b and len(a) == cfg.streams
    assert {s.rate for s in a} == {0.5 * cfg.rate, 1.5 * cfg.rate}
