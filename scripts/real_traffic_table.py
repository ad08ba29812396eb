"""Markdown rows of tokenflow against fcfs from `tokenflow simulate --trace ... --json` files (docs/results/real_traffic.md).

    python scripts/real_traffic_table.py docs/results/runs/real_traffic/sim_h200_conv_0_10_x*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(path: Path) -> str:
    out = json.loads(path.read_text())
    f, t, g = out["policies"]["fcfs"], out["policies"]["tokenflow"], out["guards"]["tokenflow_vs_fcfs"]
    bad = [n for n, c in g["checks"].items() if not c["ok"]]

    def pair(key: str, fmt: str) -> str:
        return f"{format(f[key], fmt)} / {format(t[key], fmt)}"

    st = out["setup"]
    trace = Path(st["trace"]).stem.removeprefix("azure_").removesuffix("_2023")
    window = f" min {st['window'][0]:g}-{st['window'][0] + st['window'][1]:g}" if st["window"] else ""
    return (f"| {st['gpu']} {trace}{window} {st['speed']:g}x | {g['regime']} | {pair('ttft_mean_s', '.2f')} | "
            f"{pair('ttft_p99_s', '.2f')} | {pair('qoe_mean', '.3f')} | {pair('stall_per_stream_mean_s', '.2f')} | "
            f"{pair('stall_per_stream_p99_s', '.2f')} | {pair('raw_tput', '.0f')} | {pair('effective_tput', '.0f')} | "
            f"{f['preemptions']} / {t['preemptions']} | {'all met' if not bad else 'not met: ' + ', '.join(bad)} |")


def main(paths: list[str]) -> None:
    print("| point | regime | TTFT mean (s) | TTFT P99 (s) | QoE | stall/stream mean (s) | stall P99 (s) | raw tok/s "
          "| effective tok/s | preemptions | guards |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in sorted(paths, key=lambda p: (json.loads(Path(p).read_text())["setup"]["gpu"],
                                          json.loads(Path(p).read_text())["setup"]["speed"])):
        print(row(Path(p)))


if __name__ == "__main__":
    main(sys.argv[1:])
