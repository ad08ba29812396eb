"""Run by test_cluster.py in its own process: a 2-raylet `ray.cluster_utils.Cluster`, a 2-worker SPREAD training run
over an image folder holding corrupt files; prints one JSON line with the node ids the workers reported."""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from tests.tokenizer_training.test_data import write_image_folder
    from tokenflow_ray.tokenizer.training.config import TrainConfig
    from tokenflow_ray.tokenizer.training.trainer import run_training

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "object_store_memory": 150 << 20})
    cluster.add_node(num_cpus=2, object_store_memory=150 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        tmp = Path(tempfile.mkdtemp())
        corrupt = write_image_folder(tmp / "imgs", n_good=60)
        cfg = TrainConfig().replace(
            data={"source": "images", "path": str(tmp / "imgs"), "batch_size": 8},
            optim={"lr": 1e-3, "ema_decay": 0.9},
            schedule={"steps": 8, "log_every": 4, "checkpoint_every": 8},
            # SPREAD: one worker per raylet. Both raylets share this machine's disk, standing in for shared storage.
            # torch DDP here (the flat sync is what the single-node test runs): both gradient paths cross nodes.
            scaling={"num_workers": 2, "cpus_per_worker": 0.5, "placement_strategy": "SPREAD", "grad_sync": "ddp"},
            run={"name": "cluster", "storage_path": str(tmp / "runs")})
        run = run_training(cfg, show_progress=False)
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        print(json.dumps({"cluster_nodes": nodes, "worker_node_ids": run.metrics["worker_node_ids"],
                          "step": run.metrics["step"], "skipped_images": run.metrics["skipped_images"],
                          "corrupt_files": corrupt}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
