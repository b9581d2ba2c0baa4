"""Reports: the markdown table and the plot of a run's results."""

from __future__ import annotations

import statistics

from .measure import format_breakdown
from .variants import EXTRA_VARIANTS, VARIANTS

COLUMNS = (
    "step ms",
    "vs fp32 eager",
    "vs {base}",
    "paired",
    "infer ms",
    "saved MiB",
    "peak MiB",
    "first call s",
    "casts",
    "grad cos",
)


def baseline(workload: dict) -> str | None:
    """The variant the ratio columns divide by: Inductor + autocast, or Inductor FP32 in a run
    without 16-bit variants (``auto`` where 16 bit is emulated: the target there is FP32's)."""
    return next((n for n in ("autocast-inductor", "fp32-inductor") if n in workload["variants"]), None)


def paired_ratio(samples: list[float], base: list[float]) -> float:
    """Median over repetitions of a variant's step time over the baseline's in the same
    repetition: each repetition runs every variant back to back, so a shared machine's
    drift between repetitions cancels (the ratio of medians does not cancel it)."""
    return statistics.median(s / b for s, b in zip(samples, base))


def _has_kernels(workload: dict) -> bool:
    """Whether the run counted kernels (runs before the column have none: shown as they were)."""
    return any("kernels" in r for r in workload["variants"].values())


def _has_breakdown(workload: dict) -> bool:
    return any(r.get("breakdown") for r in workload["variants"].values())


def rows(workload: dict) -> list[tuple[str, ...]]:
    out = []
    base = workload["variants"].get(baseline(workload))
    kernels = _has_kernels(workload)
    breakdown = _has_breakdown(workload)
    for name, r in workload["variants"].items():
        paired = f"{paired_ratio(r['step_ms_samples'], base['step_ms_samples']):.2f}" if base else "-"
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}" if base else "-"
        out.append(
            (
                name,
                f"{r['step_ms']:.1f}",
                f"{r['vs_fp32_eager']:.2f}x" if "vs_fp32_eager" in r else "-",
                ratio,
                paired,
                f"{r['infer_ms']:.1f}",
                f"{r['saved_bytes'] / 2**20:.1f}",
                f"{r['peak_bytes'] / 2**20:.1f}" if r.get("peak_bytes") is not None else "-",
                f"{r['first_call_s']:.1f}",
                "-" if r["casts"] is None else str(r["casts"]),
                f"{r['grad_cos']:.5f}" if "grad_cos" in r else "-",
            )
            + (("-" if r.get("kernels") is None else str(r["kernels"]),) if kernels else ())
            + ((format_breakdown(r.get("breakdown")),) if breakdown else ())
            + (
                (
                    f"{r['tflops']:.3g}",
                    "-" if r.get("roofline") is None else f"{r['roofline']:.1%}",
                    "-" if r.get("mfu") is None else f"{r['mfu']:.1%}",
                )
                if "tflops" in r
                else ()
            )
        )
    return out


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"Measured {m['date']} on {m['cpu']} ({m['cpu_kind']}, {m['threads']} threads)"
        + (f", {m['gpu']}" if "gpu" in m else "")
        + f", torch {m['torch']}, dtype {m['dtype']}"
        f" ({m['dtype_reason']}); `{m['command']}`. Medians of interleaved repetitions; "
        "`vs autocast+inductor` (`vs fp32-inductor` in a run without 16-bit variants) is the ratio "
        "of median step times (below 1 is faster); `paired` the median of the ratios within each "
        "repetition, which a busy machine moves less.",
        "",
    ]
    for name, w in results["workloads"].items():
        extra = (
            (("kernels",) if _has_kernels(w) else ())
            + (("time by kind %",) if _has_breakdown(w) else ())
            + (("TFLOP/s", "of GEMM peak", "MFU") if any("tflops" in r for r in w["variants"].values()) else ())
        )
        base = "fp32-inductor" if baseline(w) == "fp32-inductor" else "autocast+inductor"
        head = ("variant",) + tuple(c.format(base=base) for c in COLUMNS) + extra
        lines += [f"**{name}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows(w)]
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"])
    names = [n for n in VARIANTS + EXTRA_VARIANTS if any(n in w["variants"] for w in results["workloads"].values())]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(workloads), 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ys = [results["workloads"][w]["variants"].get(n, {}).get("vs_fp32_eager", 0) for w in workloads]
        ax.bar([j + i * width for j in range(len(workloads))], ys, width, label=n)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("training-step speed vs FP32 eager (x)")
    m = results["machine"]
    ax.set_title(f"{m.get('gpu', m['cpu'])} - {m['dtype']}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
