"""PNG plots of a simulated setup: the headline metrics per policy, beside each other."""

from __future__ import annotations

from pathlib import Path


def plot_policies(out: dict, directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(directory).mkdir(parents=True, exist_ok=True)
    policies = out["policies"]
    names = list(policies)
    panels = (("effective_tput", "effective tok/s"), ("raw_tput", "raw tok/s"), ("ttft_p99_s", "P99 TTFT (s)"),
              ("stall_s", "stall (s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels):
        ax.bar(names, [policies[n][key] or 0 for n in names], color=["#888", "#c84", "#38c"][:len(names)])
        ax.set_title(label)
    setup = out["setup"]
    fig.suptitle(f"{setup['describe']} on {setup['deployment']} x{setup['replicas']} (simulated)")
    fig.tight_layout()
    path = str(Path(directory) / f"sim_{setup['gpu']}_{setup['name']}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return [path]
