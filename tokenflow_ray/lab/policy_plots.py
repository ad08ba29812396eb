"""PNG plots for the policy benchmark: TTFT CDF, buffer over time for a few streams, running/preempted counts."""

from __future__ import annotations

from pathlib import Path

from tokenflow_ray.metrics import buffer_timeline


def write_policy_plots(artifacts: dict, out_dir: str | Path, streams_to_show: int = 4) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for policy, (_, records) in artifacts.items():
        ttfts = sorted(r.ttft_s for r in records if r.ttft_s is not None)
        ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=policy)
    ax.set(xlabel="TTFT (s)", ylabel="fraction of streams", title="Time to first token")
    ax.legend()
    paths.append(_save(fig, out / "ttft_cdf.png"))

    fig, axes = plt.subplots(1, len(artifacts), figsize=(4 * len(artifacts), 3.2), sharey=True, squeeze=False)
    for ax, (policy, (_, records)) in zip(axes[0], artifacts.items()):
        chosen = sorted(records, key=lambda r: r.stream_id)[:: max(1, len(records) // streams_to_show)][:streams_to_show]
        for r in chosen:
            tl = buffer_timeline(r)
            ax.plot([p.t - r.arrival_s for p in tl], [p.buffer for p in tl], label=r.stream_id)
        ax.set(title=policy, xlabel="s since arrival")
    axes[0][0].set_ylabel("reader buffer (tokens)")
    paths.append(_save(fig, out / "buffer_over_time.png"))

    fig, axes = plt.subplots(1, len(artifacts), figsize=(4 * len(artifacts), 3.2), sharey=True, squeeze=False)
    for ax, (policy, (trace, _)) in zip(axes[0], artifacts.items()):
        ax.plot(trace.t, trace.running, label="running")
        ax.plot(trace.t, trace.preempted, label="paused (host)")
        ax.plot(trace.t, trace.waiting, label="waiting")
        ax.set(title=policy, xlabel="s")
    axes[0][0].set_ylabel("streams")
    axes[0][0].legend()
    paths.append(_save(fig, out / "running_preempted.png"))
    return paths


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
