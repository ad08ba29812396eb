"""One fixed-width table of what readers feel, for every bench and the simulator: TTFT mean and P99, QoE, stall per
stream (mean, P99), then raw and effective throughput and preemptions (the columns every policy result shows)."""

from __future__ import annotations

import math

COLUMNS = (  # (key in a summary dict, header, format)
    ("ttft_mean_s", "TTFT mean", "9.2f"),
    ("ttft_p99_s", "TTFT p99", "9.2f"),
    ("qoe_mean", "QoE", "6.3f"),
    ("stall_per_stream_mean_s", "stall mean", "10.2f"),
    ("stall_per_stream_p99_s", "stall p99", "9.2f"),
    ("raw_tput", "raw", "8.1f"),
    ("effective_tput", "effective", "9.1f"),
    ("preemptions", "preempt", "8d"),
)


def _cell(value: object, fmt: str) -> str:
    width = int(fmt.rstrip("fd").split(".")[0])
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—".rjust(width)
    return format(int(value) if fmt.endswith("d") else value, fmt)


def policy_table(policies: dict[str, dict], label: str = "policy") -> str:
    """Rows of `{name: summary dict}` (PolicySummary.to_dict() keys; missing keys print as —)."""
    head = f"{label:>10} " + " ".join(h.rjust(int(f.rstrip('fd').split('.')[0])) for _, h, f in COLUMNS)
    rows = [f"{name:>10} " + " ".join(_cell(s.get(k), f) for k, _, f in COLUMNS) for name, s in policies.items()]
    return "\n".join([head, *rows])
