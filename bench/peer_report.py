"""The peer benchmark's report: figure and ratio tables (text) and plots (PNG), from its JSON form.

The report is a plain dict, as written to --json:
    {"machine": {...}, "params": {...}, "skipped": {system: why},
     "systems": {system: {"command", "startup_s", "workloads": {"burst"|"single"|"realistic": Stats},
                          "sweep": {"<concurrency>": Stats}}}}
with Stats as `peer_workloads.Stats` in dict form.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Metric:
    label: str
    workload: str  # a key of "workloads", or "sweep:<c>"
    field: str
    higher_is_better: bool


METRICS = [
    Metric("burst out tok/s", "burst", "tok_per_s", True),
    Metric("burst TTFT p50 ms", "burst", "ttft_p50_ms", False),
    Metric("burst TTFT p99 ms", "burst", "ttft_p99_ms", False),
    Metric("burst ITL p50 ms", "burst", "itl_p50_ms", False),
    Metric("burst ITL p99 ms", "burst", "itl_p99_ms", False),
    Metric("single-stream tok/s", "single", "tok_per_s", True),
    Metric("single-stream TTFT p50 ms", "single", "ttft_p50_ms", False),
    Metric("realistic req/s", "realistic", "req_per_s", True),
    Metric("realistic out tok/s", "realistic", "tok_per_s", True),
    Metric("realistic e2e p50 ms", "realistic", "e2e_p50_ms", False),
    Metric("realistic e2e p99 ms", "realistic", "e2e_p99_ms", False),
    Metric("realistic TTFT p50 ms", "realistic", "ttft_p50_ms", False),
    Metric("realistic TTFT p99 ms", "realistic", "ttft_p99_ms", False),
]


def metrics_for(report: dict) -> list[Metric]:
    """The fixed metrics plus one throughput row per sweep concurrency found in the report."""
    levels = sorted({int(c) for s in report["systems"].values() for c in s.get("sweep", {})})
    return METRICS + [Metric(f"sweep c={c} tok/s", f"sweep:{c}", "tok_per_s", True) for c in levels]


def value(report: dict, system: str, m: Metric) -> float | None:
    s = report["systems"].get(system, {})
    if m.workload.startswith("sweep:"):
        stats = s.get("sweep", {}).get(m.workload.split(":", 1)[1])
    else:
        stats = s.get("workloads", {}).get(m.workload)
    return stats.get(m.field) if stats else None


def ratio_columns(systems: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator): each zerogap system over each peer, then overlap over normal."""
    ours = [s for s in systems if s.startswith("zerogap")]
    peers = [s for s in systems if not s.startswith("zerogap")]
    cols = [(z, p) for p in peers for z in ours]
    if "zerogap-overlap" in ours and "zerogap-normal" in ours:
        cols.append(("zerogap-overlap", "zerogap-normal"))
    return cols


def ratio(report: dict, num: str, den: str, m: Metric) -> float | None:
    a, b = value(report, num, m), value(report, den, m)
    return a / b if a is not None and b else None


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _short(name: str) -> str:
    return name.removeprefix("zerogap-")


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def format_report(report: dict) -> str:
    systems = list(report["systems"])
    metrics = [m for m in metrics_for(report) if any(value(report, s, m) is not None for s in systems)]
    out = [header(report), ""]
    rows = [[m.label, *(_num(value(report, s, m)) for s in systems)] for m in metrics]
    if systems:
        out += ["Figures (same run):", _table(["metric", *systems], rows), ""]
    cols = ratio_columns(systems)
    if cols:
        head = ["ratio", "better", *(f"{_short(a)}/{_short(b)}" for a, b in cols)]
        rows = [[m.label, "higher" if m.higher_is_better else "lower",
                 *(f"{r:.2f}x" if (r := ratio(report, a, b, m)) is not None else "-" for a, b in cols)]
                for m in metrics]  # fmt: skip
        rows = [r for r in rows if any(c != "-" for c in r[2:])]
        out += [
            "Ratios (zerogap / peer; 'better' says which way favours the numerator):",
            _table(head, rows),
            "",
        ]
    for name, s in report["systems"].items():
        out.append(
            f"{name}: started in {s['startup_s']:.1f} s"
            + (f": {s['command']}" if s["command"] else " (in-process)")
        )
    for name, why in report.get("skipped", {}).items():
        out.append(f"SKIPPED {name}: {why}")
    out.append("(TTFT from each request's send to its first token; ITL = every inter-token gap; e2e = send to "
               "end of stream; transformers: static batches, times per batch from its start.)")  # fmt: skip
    return "\n".join(out)


def header(report: dict) -> str:
    m, p = report["machine"], report["params"]
    flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["cpu_flags"].items())
    described = {
        "burst": f"burst: {p['num_prompts']} prompts x {p['max_new_tokens']} tokens at once",
        "single": f"single stream: {p['single_requests']} requests one after another",
        "sweep": f"sweep: concurrency {p['sweep']}",
        "realistic": f"realistic: {p['realistic']}",
    }
    return "\n".join([
        f"CPU: {m['cpu_model']} ({flags}); {m['cpu_count']} cores; load average at start {m['loadavg_at_start']}",
        f"versions: {m['versions']}",
        f"command: {m['command']}",
        "; ".join(described[w] for w in p.get("workloads", described)),
    ])  # fmt: skip


# ---- plots -------------------------------------------------------------------------------
def _cdf(ax, samples: list[float], label: str, color: str) -> None:  # noqa: ANN001 - a matplotlib Axes
    xs = sorted(samples)
    ax.step(
        [xs[0], *xs],
        [0.0, *((i + 1) / len(xs) for i in range(len(xs)))],
        where="post",
        label=label,
        color=color,
    )


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """peers_throughput.png (tok/s per system and concurrency) and peers_latency_cdf.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    m = report["machine"]
    subtitle = f"{m['cpu_model']}, {m['cpu_count']} cores, SmolLM2-135M, {report['params']['dtype']}"
    written = []
    color = {name: f"C{i}" for i, name in enumerate(report["systems"])}  # the same in every panel

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in report["systems"].items():
        pts = sorted((int(c), st["tok_per_s"]) for c, st in s.get("sweep", {}).items())
        if pts:
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=name, color=color[name])
    levels = sorted({int(c) for s in report["systems"].values() for c in s.get("sweep", {})})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrent requests (transformers: static batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Throughput by concurrency\n{subtitle}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    written.append(out_dir / "peers_throughput.png")
    fig.tight_layout()
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    panels = [("burst", "ttft_ms", "TTFT, burst (ms)"), ("burst", "itl_ms", "inter-token gap, burst (ms)")]
    if any("realistic" in s["workloads"] for s in report["systems"].values()):
        panels.append(("realistic", "e2e_ms", "end-to-end latency, realistic (ms)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (workload, key, title) in zip(axes, panels):
        for name, s in report["systems"].items():
            samples = s["workloads"].get(workload, {}).get(key)
            if samples:
                _cdf(ax, samples, name, color[name])
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}" if f"{x:e}"[0] in "235" else ""))
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Latency CDFs\n{subtitle}", fontsize=10)
    written.append(out_dir / "peers_latency_cdf.png")
    fig.tight_layout()
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
