from pathlib import Path

import pytest

from tests.script_runner import run_json_script


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_workers_run_on_both_raylets_and_corrupt_files_are_counted():
    """Own subprocess: a Cluster of two raylets cannot share the process with the session's Ray instance."""
    out = run_json_script(Path(__file__).with_name("cluster_script.py"))
    assert out["step"] == 8
    assert len(out["cluster_nodes"]) == 2
    assert sorted(set(out["worker_node_ids"])) == out["cluster_nodes"]  # one worker on each raylet
    assert out["skipped_images"] >= 1  # corrupt files in the input folder counted; training went on
