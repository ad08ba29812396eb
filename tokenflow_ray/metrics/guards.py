"""Reader-felt guards: is a policy (T) no worse than a baseline (F) on the same requests, by what readers feel?

The thresholds of the real-traffic issue (docs/results/real_traffic.md), judged on two `PolicySummary.to_dict()`s:
- always: QoE(T) >= QoE(F) - 0.005; TTFT mean(T) <= 1.05 F + 0.05 s; raw(T) >= 0.97 F;
- where F keeps up (its P99 TTFT <= 2 s): stall per stream mean(T) <= F + 0.1 s; P99 TTFT(T) <= 1.1 F + 0.1 s;
- where it does not: TTFT mean(T) <= 0.5 F and effective(T) >= 1.3 F (the paper's real-trace figures).
A guard whose inputs are missing (no stream started) reads as failed, never as passed.
"""

from __future__ import annotations

KEEPS_UP_P99_TTFT_S = 2.0
# The "always" guards; `overload` adds the paper's real-trace goals, which are goals, not harm checks.
HARM_GUARDS = ("qoe", "ttft_mean", "raw_tput", "stall_mean", "ttft_p99")


def _num(summary: dict, key: str) -> float | None:
    v = summary.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def fcfs_keeps_up(baseline: dict) -> bool:
    p99 = _num(baseline, "ttft_p99_s")
    return p99 is not None and p99 <= KEEPS_UP_P99_TTFT_S


def guards(policy: dict, baseline: dict) -> dict:
    """{regime, checks: {name: {ok, value, limit}}, ok (every check), harm_ok (the checks that say "no worse")}."""
    def check(name: str, key: str, limit_of, at_least: bool) -> None:
        t, f = _num(policy, key), _num(baseline, key)
        limit = None if f is None else limit_of(f)
        ok = t is not None and limit is not None and (t >= limit if at_least else t <= limit)
        checks[name] = {"ok": ok, "value": t, "limit": limit, "baseline": f}

    checks: dict[str, dict] = {}
    check("qoe", "qoe_mean", lambda f: f - 0.005, at_least=True)
    check("ttft_mean", "ttft_mean_s", lambda f: 1.05 * f + 0.05, at_least=False)
    check("raw_tput", "raw_tput", lambda f: 0.97 * f, at_least=True)
    keeps_up = fcfs_keeps_up(baseline)
    if keeps_up:
        check("stall_mean", "stall_per_stream_mean_s", lambda f: f + 0.1, at_least=False)
        check("ttft_p99", "ttft_p99_s", lambda f: 1.1 * f + 0.1, at_least=False)
    else:
        check("ttft_mean_gain", "ttft_mean_s", lambda f: 0.5 * f, at_least=False)
        check("effective_gain", "effective_tput", lambda f: 1.3 * f, at_least=True)
    return {"regime": "fcfs keeps up" if keeps_up else "overload",
            "checks": checks, "ok": all(c["ok"] for c in checks.values()),
            "harm_ok": all(c["ok"] for n, c in checks.items() if n in HARM_GUARDS)}


def failed(report: dict) -> list[str]:
    return [name for name, c in report["checks"].items() if not c["ok"]]


def describe(report: dict) -> str:
    """One line: the regime and each guard as ok or FAIL with its value against its limit."""
    def fmt(x: float | None) -> str:
        return "—" if x is None else f"{x:.3g}"

    parts = [f"{name} {'ok' if c['ok'] else 'FAIL'} ({fmt(c['value'])} vs {fmt(c['limit'])})"
             for name, c in report["checks"].items()]
    return f"[{report['regime']}] " + ", ".join(parts)
