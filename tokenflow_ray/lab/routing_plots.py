"""`tokenflow bench routing` plot (PNG): live streams per replica over time, one panel per router."""

from __future__ import annotations

from pathlib import Path

from tokenflow_ray.lab.routing_bench import RoutingRun


def write_routing_plot(runs: dict[str, list[RoutingRun]], path: str | Path) -> Path:
    """The first round of each router (every round runs the same burst); a step line per replica."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [n for n, rs in runs.items() if rs]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        run = runs[name][0]
        replicas = sorted({rid for _, counts in run.timeline for rid in counts})
        for rid in replicas:
            ax.step([t for t, _ in run.timeline], [c.get(rid, 0) for _, c in run.timeline], where="post",
                    label=f"{rid} ({run.per_replica.get(rid, 0)} streams)")
        ax.set(title=f"router: {name}", xlabel="time since the burst began (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("live streams on the replica")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
