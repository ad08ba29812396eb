"""Demo plots (PNG): TTFT CDF per policy, and client buffer over time for a few streams."""

from __future__ import annotations

from pathlib import Path

from tokenflow_ray.client.load import LoadResult


def write_ttft_cdf(runs: dict[str, LoadResult], path: Path, title: str,
                   colors: dict[str, str] | None = None) -> Path:
    """One step curve per run: the fraction of its streams whose first token came within t."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in runs.items():
        ttfts = sorted(r.ttft_s for r in res.records if r.ttft_s is not None)
        if ttfts:
            ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=name,
                    color=(colors or {}).get(name))
    ax.set(xlabel="TTFT (s)", ylabel="fraction of streams", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(runs: dict[str, LoadResult], out_dir: str | Path, streams_shown: int = 4) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    paths.append(write_ttft_cdf(runs, out / "ttft_cdf.png", "Time to first token under a burst"))

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), sharey=True, squeeze=False)
    for ax, (name, res) in zip(axes[0], runs.items()):
        records = [r for r in res.records if r.token_times]
        step = max(1, len(records) // streams_shown)
        for r in records[::step][:streams_shown]:
            ax.plot(r.token_times, r.token_buffers, drawstyle="steps-post", label=r.stream_id[-6:])
        ax.set(title=f"{name}: client buffer", xlabel="time since burst (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("buffered tokens")
    paths.append(out / "buffers.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
