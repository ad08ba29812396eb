"""Peer plots (PNG, Agg): TTFT CDF per system, and effective vs raw throughput per system."""

from __future__ import annotations

from pathlib import Path

from tokenflow_ray.client.load import LoadResult
from tokenflow_ray.lab.demo_plots import write_ttft_cdf

COLORS = {"fcfs": "tab:orange", "tokenflow": "tab:blue", "vllm": "tab:green"}


def write_peer_plots(runs: dict[str, LoadResult], report: dict, out_dir: str | Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    w = report["workload"]
    subtitle = f"{w['name']}, {w['streams']} streams x {w['max_tokens']} tokens"
    paths: list[Path] = []

    paths.append(write_ttft_cdf(runs, out / "ttft_cdf.png", f"Time to first token ({subtitle})", COLORS))

    systems = [(n, s) for n, s in report["systems"].items() if "error" not in s]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    xs = range(len(systems))
    raw = [s["raw_tput"] or 0.0 for _, s in systems]
    eff = [s["effective_tput"] or 0.0 for _, s in systems]
    ax.bar([x - width / 2 for x in xs], raw, width, label="raw (all tokens)", color="lightgray", edgecolor="gray")
    ax.bar([x + width / 2 for x in xs], eff, width, label="effective (weighted by buffer)",
           color=[COLORS.get(n, "tab:purple") for n, _ in systems])
    ax.set_xticks(list(xs), [n for n, _ in systems])
    ax.set(ylabel="tokens/s", title=f"Effective vs raw throughput ({subtitle})")
    ax.set_ylim(0, 1.3 * max(raw + eff + [1.0]))  # headroom: the legend sits above the bars
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", ncol=2, fontsize="small")
    paths.append(out / "throughput.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return [str(p) for p in paths]
