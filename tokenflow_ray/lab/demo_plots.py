"""Demo plots (PNG): TTFT CDF per policy, and client buffer over time for a few streams.

The buffer plot replays each reader (metrics/reader.py, the model the client itself ran): the buffer rises at each
token arrival and drains at the declared rate between arrivals, one token per 1/rate s, down to 0, where the
reader waits (a stall, drawn thick at 0). Plotting only the values recorded at arrivals would show flat steps, as if
the reader never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenflow_ray.client.load import LoadResult
from tokenflow_ray.metrics.stream_metrics import StreamRecord

SAMPLES_PER_READ = 4  # buffer samples per read interval (1/rate s) between arrivals
MAX_SAMPLES = 20_000  # per stream: a long slow stream is sampled more coarsely


@dataclass(frozen=True)
class BufferTrace:
    times: list[float]  # non-decreasing; an arrival appears twice (buffer before, then after its tokens)
    buffers: list[float]  # unread tokens at each time
    stalls: list[tuple[float, float]]  # spans where the reader waited on an empty buffer for a next token


def buffer_trace(record: StreamRecord) -> BufferTrace:
    """The reader's buffer over the stream's life, from the first token to the last token read."""
    from tokenflow_ray.metrics.reader import ReaderModel

    arrivals: list[tuple[float, int]] = []  # (time, tokens) with tokens of one delta grouped
    for t in record.token_times:
        if arrivals and arrivals[-1][0] == t:
            arrivals[-1] = (t, arrivals[-1][1] + 1)
        else:
            arrivals.append((t, 1))
    if not arrivals or record.rate <= 0:  # an unpaced reader takes every token at once: its buffer is always 0
        return BufferTrace([a[0] for a in arrivals], [0.0] * len(arrivals), [])
    reader = ReaderModel(record.rate)
    span = arrivals[-1][0] - arrivals[0][0] + sum(n for _, n in arrivals) / record.rate
    dt = max(1.0 / (SAMPLES_PER_READ * record.rate), span / MAX_SAMPLES)
    times: list[float] = []
    buffers: list[float] = []

    def sample(t: float) -> None:
        times.append(t)
        buffers.append(float(reader.buffer_at(t)))

    for i, (t, n) in enumerate(arrivals):
        sample(t)
        reader.on_tokens(t, n)
        sample(t)
        end = arrivals[i + 1][0] if i + 1 < len(arrivals) else t + reader.buffer_at(t) / record.rate
        k = 1
        while t + k * dt < end:
            sample(t + k * dt)
            k += 1
    sample(max(times[-1], end) + dt)  # past the last read (rounding must not leave it unread)
    return BufferTrace(times, buffers, _stalls(times, buffers, arrivals[-1][0]))


def _stalls(times: list[float], buffers: list[float], last_arrival: float) -> list[tuple[float, float]]:
    """Spans with an empty buffer before the last arrival (after it, an empty buffer is the stream's end)."""
    spans, start = [], None
    for t, b in zip(times, buffers):
        if b == 0 and start is None and t < last_arrival:
            start = t
        elif b > 0 and start is not None:
            if t > start:
                spans.append((start, t))
            start = None
    return spans


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
            trace = buffer_trace(r)
            (line,) = ax.plot(trace.times, trace.buffers, drawstyle="steps-post", linewidth=1.0,
                              label=r.stream_id[-6:])
            for a, b in trace.stalls:
                ax.plot([a, b], [0, 0], color=line.get_color(), linewidth=4, alpha=0.6, solid_capstyle="butt")
        ax.set(title=f"{name}: client buffer (thick at 0: stalled)", xlabel="time since burst (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("buffered tokens")
    paths.append(out / "buffers.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
