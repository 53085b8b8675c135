"""`pdserve bench serve --plot`: latency distributions per app, and ITL over time."""

from __future__ import annotations

from pdserve.bench.workloads import RequestResult


def plot(raw: dict[str, list[RequestResult]], path: str) -> None:
    """Top: TTFT, TPOT, ITL and end-to-end histograms, one colour per app. Bottom: every
    inter-token latency against when it ended, per app (a burst of prefills stalling running
    streams shows as a column of high points), with the bursts' arrivals marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 10))
    grid = fig.add_gridspec(3, 2)
    panels = {
        "TTFT (ms)": lambda r: [r.ttft_s * 1e3],
        "TPOT (ms)": lambda r: [r.tpot_s * 1e3] if r.num_output_tokens > 1 else [],
        "ITL (ms)": lambda r: [x * 1e3 for x in r.itl_s],
        "end-to-end (ms)": lambda r: [r.e2e_s * 1e3],
    }
    for i, (title, pick) in enumerate(panels.items()):
        ax = fig.add_subplot(grid[i // 2, i % 2])
        for app, results in raw.items():
            values = [v for r in results if r.ok for v in pick(r)]
            if values:
                ax.hist(values, bins=40, alpha=0.55, label=app)
        ax.set_title(title)
        ax.legend()
    ax = fig.add_subplot(grid[2, :])
    for app, results in raw.items():
        times = [t for r in results if r.ok for t in r.itl_times_s()]
        gaps = [g * 1e3 for r in results if r.ok for g in r.itl_s]
        ax.scatter(times, gaps, s=3, alpha=0.5, label=f"{app} ITL")
        bursts = sorted({round(r.start_s, 1) for r in results if r.kind == "burst"})
        for j, at in enumerate(bursts):
            ax.axvline(at, alpha=0.2, linestyle="--", label=f"{app} bursts" if j == 0 else None)
    ax.set_title("ITL over time")
    ax.set_xlabel("seconds since the workload started")
    ax.set_ylabel("ITL (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
