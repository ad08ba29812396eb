"""Live migration in the multi-replica simulator: the central actor's own table and relief policy, the engine's
own export/import, on one virtual clock, with the conservation and table checks on throughout."""

from __future__ import annotations

import json

import pytest

from tokenflow_ray.cli import main
from tokenflow_ray.cluster import change_log, migration_policy, stream_table
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.sim import migration as sim_migration
from tokenflow_ray.sim.experiments import run_setup
from tokenflow_ray.sim.migration import MigrationLink
from tokenflow_ray.sim.setups import gpu_replica_setup
from tokenflow_ray.sim.simulator import Simulation
from tokenflow_ray.workloads.generators import LengthDist, RequestSpec, WorkloadSpec, make_requests

SETTINGS = migration_policy.MigrationSettings(interval_s=0.5)


def _requests(n: int = 30) -> list[RequestSpec]:
    """A burst at 1/8 of Table 1's lengths (~64-token prompts, ~256-token outputs), 20 tok/s readers."""
    spec = WorkloadSpec("burst", n, seed=0, rate=20.0, prompt=LengthDist(64, 16, min_len=8),
                        output=LengthDist(256, 64, min_len=16), length_scale=1.0)
    return make_requests(spec)


def _sim(on: bool = True, link: MigrationLink | None = None, replicas: int = 3) -> Simulation:
    """Every arrival pinned to r000, whose pool holds ~1/3 of the burst: a hot replica beside idle ones."""
    setup = gpu_replica_setup("4090", "llama3-8b", "tokenflow",
                              cache_overrides={"num_device_blocks": 160, "num_host_blocks": 640})
    return Simulation(setup, num_replicas=replicas, router="pinned", checks=True, integrity=True,
                      migration=SETTINGS, migration_on=on, migration_link=link)


def test_the_simulator_drives_the_central_actors_own_table_policy_and_the_engines_export(monkeypatch):
    # The very objects serve/central.py and serve/replica.py use, not copies.
    assert sim_migration.plan_relief is migration_policy.plan_relief
    assert sim_migration.pick_streams is migration_policy.pick_streams
    assert sim_migration.StreamTable is stream_table.StreamTable and sim_migration.ChangeLog is change_log.ChangeLog
    calls: dict[str, int] = {}

    def count(owner, name):
        original = getattr(owner, name)

        def counted(*a, _original=original, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*a, **k)

        monkeypatch.setattr(owner, name, counted)

    for cls, name in ((stream_table.StreamTable, "apply_changes"), (stream_table.StreamTable, "move"),
                      (change_log.ChangeLog, "drain"), (change_log.ChangeLog, "moved_out"),
                      (LLMEngine, "begin_export"), (LLMEngine, "try_export"), (LLMEngine, "import_stream")):
        count(cls, name)
    count(sim_migration, "plan_relief")
    count(sim_migration, "pick_streams")
    sim = _sim()
    mig = sim.migration
    assert type(mig.table) is stream_table.StreamTable and all(type(log) is change_log.ChangeLog for log in mig.logs)
    assert mig.engines == [r.engine for r in sim.replicas]
    outcome = sim.run(_requests())
    moves = mig.totals.migrations
    assert moves > 0
    assert calls["apply_changes"] == calls["drain"] == 3 * mig.totals.ticks
    assert calls["plan_relief"] == mig.totals.ticks and calls["pick_streams"] == mig.totals.reliefs > 0
    assert calls["begin_export"] == calls["moved_out"] == calls["move"] == calls["import_stream"] == moves
    assert calls["try_export"] >= moves
    assert len(outcome.records) == 30


def test_a_hot_replica_moves_paused_streams_and_every_moved_stream_completes():
    requests = _requests()
    sim = _sim()
    outcome = sim.run(requests)  # conservation + block integrity after every step, table checks on every tick
    mig = outcome.migration
    t = mig.totals
    assert t.migrations > 0 and t.moved_streams and t.taken_back == 0
    counts = outcome.per_replica_streams
    assert counts["r000"] < 30 and counts["r001"] + counts["r002"] == 30 - counts["r000"] > 0, counts
    by_id = {r.stream_id: r for r in outcome.records}
    want = {f"req-{r.index}": r.output_len for r in requests}
    assert set(by_id) == set(want)
    for sid in t.moved_streams:
        rec = by_id[sid]
        assert rec.finished and rec.migrations >= 1
        assert len(rec.token_times) == want[sid], sid  # none lost, none doubled across the move
        assert rec.token_times == sorted(rec.token_times)
    assert all(len(r.token_times) == want[r.stream_id] for r in outcome.records)
    assert sum(r.migrations for r in outcome.records) == t.migrations
    # The moved KV was read out of the sources' host stores and written into the targets': every block exported was
    # imported once (a stream moved on from a relieved replica is exported there again), the hot one's first.
    runners = [r.runner.totals for r in outcome.replicas]
    assert sum(x.blocks_exported for x in runners) == sum(x.blocks_imported for x in runners) > 0
    assert runners[0].blocks_exported > 0 and runners[0].blocks_imported == 0
    assert t.kv_bytes > 0
    # Everything ended: the table holds no live stream, and no move is under way.
    assert not mig.busy and not mig.table.streams and all(not log.live for log in mig.logs)
    mig.table.check_integrity()


def test_a_move_costs_its_transfer_time_over_the_link():
    fast = _sim(link=MigrationLink(bytes_s=11e9, latency_s=5e-3))
    fast.run(_requests())
    t = fast.migration.totals
    link = fast.migration.link
    assert t.transfer_s == pytest.approx(t.migrations * link.latency_s + t.kv_bytes / link.bytes_s)
    assert t.transfer_s_max > link.latency_s
    slow = _sim(link=MigrationLink(bytes_s=2e8, latency_s=0.2))  # 200 MB/s: a move takes a good part of a second
    outcome = slow.run(_requests())
    ts = slow.migration.totals
    assert ts.migrations > 0 and ts.transfer_s_max > 0.2 + 1e6 / 2e8
    assert all(r.finished for r in outcome.records)


def test_a_move_the_target_refuses_goes_back_to_its_source():
    sim = _sim()
    refused = []

    def refuse(exported, elapsed_s=0.0, moved=True):
        refused.append(exported.stream_id)
        raise ValueError("no room")

    for r in sim.replicas[1:]:
        r.engine.import_stream = refuse
    outcome = sim.run(_requests())
    t = outcome.migration.totals
    assert refused and t.taken_back == len(refused) and t.migrations == 0
    assert outcome.per_replica_streams["r000"] == 30 and all(r.finished for r in outcome.records)
    assert all(r.migrations == 0 for r in outcome.records)


def test_without_moves_the_table_is_still_fed_and_nothing_leaves_the_hot_replica():
    outcome = _sim(on=False).run(_requests())
    t = outcome.migration.totals
    assert t.ticks > 0 and t.migrations == t.reliefs == 0
    assert outcome.per_replica_streams == {"r000": 30, "r001": 0, "r002": 0}
    assert all(r.migrations == 0 for r in outcome.records)


def test_feeding_the_table_does_not_change_the_run():
    """The comparison run (table fed and checked, nothing moved) is the run without the central actor at all."""
    setup = gpu_replica_setup("4090", "llama3-8b", "tokenflow",
                              cache_overrides={"num_device_blocks": 160, "num_host_blocks": 640})
    plain = Simulation(setup, num_replicas=3, router="slack").run(_requests())
    fed = Simulation(setup, num_replicas=3, router="slack", migration=SETTINGS, migration_on=False).run(_requests())
    key = [(r.stream_id, r.token_times, r.preemptions) for r in plain.records]
    assert key == [(r.stream_id, r.token_times, r.preemptions) for r in fed.records]
    assert fed.migration.totals.ticks > 0


def test_the_table_check_catches_a_stream_the_table_never_heard_of():
    sim = _sim()
    sim.migration.tick(0.0)
    engine = sim.replicas[1].engine
    engine.add_request((1,) * 8, SamplingParams(max_tokens=4, ignore_eos=True), stream_id="ghost", arrival_time=0.0)
    with pytest.raises(AssertionError, match="change log"):
        sim.migration.tick(0.5)


def _dump(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True)


def test_a_seed_with_migration_gives_identical_json():
    kwargs = dict(policies=("fcfs", "tokenflow"), replicas=3, router="pinned", num_requests=30, migration=SETTINGS)
    a = run_setup("4090", "llama3-8b", "a", seed=1, **kwargs)
    b = run_setup("4090", "llama3-8b", "a", seed=1, **kwargs)
    assert _dump(a) == _dump(b)
    m = a["migration"]
    assert set(m) == {"settings", "link", "policies", "ours", "vs_no_migration"}
    assert m["policies"]["tokenflow"]["migration"]["migrations"] > 0
    assert a["policies"]["tokenflow"]["migration"]["migrations"] == 0  # the run without moves
    assert m["vs_no_migration"]["tokenflow"]["effective_tput"] > 0


def test_bad_migration_arguments_are_rejected(capsys):
    setup = gpu_replica_setup("4090", "llama3-8b", "fcfs")
    with pytest.raises(ValueError, match="replicas >= 2"):
        Simulation(setup, num_replicas=1, migration=SETTINGS)
    with pytest.raises(ValueError, match="bytes_s"):
        MigrationLink(bytes_s=0)
    for argv in (["simulate", "--migration"], ["simulate", "--migration", "--replicas", "2", "--table"]):
        assert main([*argv, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tokenflow: error:") and "--migration" in err and "\n" not in err


def test_the_cli_writes_both_runs_and_the_settings(tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main(["simulate", "--gpu", "4090", "--setup", "a", "--requests", "30", "--policy", "tokenflow",
                 "--replicas", "3", "--router", "pinned", "--migration", "--migration-waiting",
                 "--migration-interval", "0.5", "--json", str(path), "--no-progress"]) == 0
    out = json.loads(path.read_text())
    m = out["migration"]
    assert m["settings"]["move_waiting"] is True and m["settings"]["interval_s"] == 0.5
    assert m["link"] == {"bytes_s": 11e9, "latency_s": 5e-3}
    assert out["setup"]["router"] == "pinned" and out["setup"]["replicas"] == 3
    moved = m["policies"]["tokenflow"]
    assert moved["migration"]["migrations"] == moved["stream_migrations"] > 0
    assert "with migration:" in capsys.readouterr().out
