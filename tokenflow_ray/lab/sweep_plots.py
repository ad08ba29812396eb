"""The sweep's one PNG: effective throughput and P99 TTFT against load, one line per policy (or peer system).

Lines are the swept workload's points (the burst, for `bench policies --sweep`); other workloads in the sweep (the
presets) are unconnected hollow markers at their load, one shape per preset, in the policy's colour, nudged
right so they do not hide the line's point at the same load. The effective panel also draws Σ declared rates
(load x Γ): what the readers ask for, the ceiling of effective throughput when every token is read in time.
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"fcfs": "tab:orange", "andes": "tab:green", "tokenflow": "tab:blue", "vllm": "tab:purple"}
PRESET_MARKERS = {"poisson": "s", "gamma": "^", "mixed": "D", "burst": "o"}


def write_sweep_plot(sweep: list[dict], path: str | Path, line_workload: str = "burst",
                     title: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    line = sorted((p for p in sweep if p["workload"] == line_workload), key=lambda p: p["load"])
    others = [p for p in sweep if p["workload"] != line_workload]
    names = list(dict.fromkeys(name for p in sweep for name in p["policies"]))
    loads = [p["load"] for p in sweep]
    nudge = 0.025 * max(max(loads) - min(loads), 0.5)
    kinds = list(dict.fromkeys(p["workload"] for p in others))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("effective_tput", "effective throughput (tok/s)"), ("ttft_p99_s", "P99 TTFT (s)"))
    for ax, (key, label) in zip(axes, panels):
        for name in names:
            color = COLORS.get(name, "tab:gray")
            xs = [p["load"] for p in line if _value(p, name, key) is not None]
            ys = [_value(p, name, key) for p in line if _value(p, name, key) is not None]
            if xs:
                ax.plot(xs, ys, "o-", color=color, label=name)
            for p in others:
                y = _value(p, name, key)
                if y is not None:
                    offset = (kinds.index(p["workload"]) + 1) * nudge  # right of the line's point
                    ax.plot(p["load"] + offset, y, PRESET_MARKERS.get(p["workload"], "x"), color=color,
                            markerfacecolor="none", markersize=8, linestyle="none")
        if key == "effective_tput" and line:
            ax.plot([p["load"] for p in line], [p["sum_rates"] for p in line], ":", color="gray",
                    label="Σ declared rates")
        ax.axvline(1.0, color="lightgray", linewidth=0.8, zorder=0)
        ax.set(xlabel="load (Σ declared rates / measured decode capacity Γ)", ylabel=label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for kind in kinds:  # legend entries for the preset shapes, in neutral grey
        at = ", ".join(f"{p['load']:g}" for p in others if p["workload"] == kind)
        axes[1].plot([], [], PRESET_MARKERS.get(kind, "x"), color="gray", markerfacecolor="none", linestyle="none",
                     label=f"{kind} (load {at})")
    axes[0].legend(fontsize="small")
    if kinds:
        axes[1].legend(fontsize="small")
    gamma = sweep[0].get("gamma_tok_s") if sweep else None
    fig.suptitle(title or f"{line_workload} across loads" + (f" (Γ = {gamma:.0f} tok/s)" if gamma else ""))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)


def _value(point: dict, name: str, key: str) -> float | None:
    value = point["policies"].get(name, {}).get(key)
    return value if isinstance(value, (int, float)) else None
