"""Markdown table and PNGs (probe accuracy vs PSNR; sorted cluster-size distribution) from the experiment JSON."""

from __future__ import annotations

from pathlib import Path

ROWS = (("psnr", "PSNR dB", 2), ("ssim", "SSIM", 3), ("digit_acc", "digit (ids)", 3), ("color_acc", "colour (ids)", 3),
        ("digit_acc_emb", "digit (emb)", 3), ("color_acc_emb", "colour (emb)", 3), ("usage", "usage", 3),
        ("perplexity", "perplexity", 1), ("nmi_digit", "NMI digit", 3), ("nmi_color", "NMI colour", 3))


def markdown_table(result: dict) -> str:
    entries = dict(result["arms"])
    entries.update({f"TF(w={w})": v for w, v in result["w_sweep"].items() if w not in ("0", "1", "inf")})
    head = "| arm | tokens | " + " | ".join(r[1] for r in ROWS) + " |"
    lines = [head, "|" + "---|" * (len(ROWS) + 2)]
    for name, m in entries.items():
        cells = [f"{m[k]:.{d}f} ± {m['std'][k]:.{d}f}" for k, _, d in ROWS]
        lines.append(f"| {name} | {m['tokens_per_image']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_plots(result: dict, out_dir: str | Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    sweep = sorted(((float(w), m) for w, m in result["w_sweep"].items()), key=lambda t: t[0])
    ax.plot([m["psnr"] for _, m in sweep], [m["digit_acc"] for _, m in sweep], "-", color="grey", alpha=0.5,
            label="w sweep (S: w=0 ... P: w=inf)")
    for name, m in result["arms"].items():
        ax.errorbar(m["psnr"], m["digit_acc"], xerr=m["std"]["psnr"], yerr=m["std"]["digit_acc"], fmt="o",
                    capsize=3, label=f"{name} digit")
        ax.errorbar(m["psnr"], m["color_acc"], xerr=m["std"]["psnr"], yerr=m["std"]["color_acc"], fmt="x",
                    capsize=3, color=ax.lines[-1].get_color(), alpha=0.6)
    for w, m in sweep:
        if w not in (0.0, 1.0, float("inf")):
            ax.annotate(f"w={w:g}", (m["psnr"], m["digit_acc"]), fontsize=8)
    ax.set_xlabel("PSNR on split C (dB)")
    ax.set_ylabel("probe accuracy on C (o digit, x colour)")
    ax.set_title("Token-id probes vs reconstruction (mean ± std over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    acc_path = out / "accuracy_vs_psnr.png"
    fig.savefig(acc_path, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("P", "S", "TF"):
        sizes = result["arms"][name]["cluster_sizes_seed0"]
        ax.plot(range(1, len(sizes) + 1), sizes, label=name)
    ax.set_xlabel("code rank")
    ax.set_ylabel("tokens on split C (seed 0)")
    ax.set_yscale("log")
    ax.set_title("Codebook usage: sorted cluster sizes")
    ax.legend()
    fig.tight_layout()
    usage_path = out / "usage_histogram.png"
    fig.savefig(usage_path, dpi=110)
    plt.close(fig)
    return [str(acc_path), str(usage_path)]
