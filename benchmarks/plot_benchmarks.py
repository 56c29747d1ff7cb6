"""Grouped bars of bench.py's throughput per model shape, from benchmarks.csv (BENCHMARKS.md's
figures).

    python benchmarks/plot_benchmarks.py   # benchmarks/benchmarks.csv -> benchmarks/benchmarks.png
    python benchmarks/plot_benchmarks.py --csv my.csv --out my.png

One panel per shape (in the CSV's order), on that shape's device; in it one bar per system of
SYSTEMS (one colour each), the tok/s of the system's last row in the file, with its share of the
memory floor for its KV-cache dtype written in the bar; the floors (bench_floor.py) as lines.
benchmarks.csv keeps every recorded figure in the order measured: append a row (shape, system,
tok/s median, the runs, device, date, commit, command) and the plot shows it. Rows of other
systems (transformers, tensor parallelism) stay in the CSV and out of the plot.

Run it from the repository root as ``python benchmarks/plot_benchmarks.py``; it imports nothing
from ``bench.py``. Needs matplotlib (``pip install matplotlib``, or the ``bench`` extra); the
library itself does not.
"""

import argparse
import csv
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = ("shape", "system", "tok_s", "runs", "device", "date", "commit", "command")
SYSTEMS = {  # bar order and colour
    "original nano-vllm": "#8c8c8c",
    "flash-attn bf16": "#4c72b0",
    "Triton bf16": "#55a868",
    "Triton FP8 KV": "#dd8452",
}
FLOOR_BF16, FLOOR_FP8 = "memory floor, bf16 KV", "memory floor, FP8 KV"


def read_rows(path: str | Path) -> list[dict]:
    """The CSV's rows in file order, tok/s as floats."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {', '.join(sorted(missing))}")
        rows = list(reader)
    for i, row in enumerate(rows, start=2):
        try:
            row["tok_s"] = float(row["tok_s"])
        except ValueError:
            raise ValueError(f"{path}, line {i}: tok_s {row['tok_s']!r} is not a number") from None
    return rows


def latest(rows: list[dict]) -> dict[str, tuple[str, dict[str, dict]]]:
    """shape -> (its device: that of the shape's last row, {system: its last row on that device}),
    shapes in order of first appearance."""
    shapes: dict[str, tuple[str, dict[str, dict]]] = {}
    for row in rows:
        shapes.setdefault(row["shape"], ("", {}))
    for shape in shapes:
        own = [r for r in rows if r["shape"] == shape]
        device = own[-1]["device"]
        shapes[shape] = (device, {r["system"]: r for r in own if r["device"] == device})
    return shapes


def floor_of(system: str, figures: dict[str, dict]) -> float | None:
    """The memory floor a system's figure is compared with: that of its KV-cache dtype."""
    row = figures.get(FLOOR_FP8 if "FP8" in system else FLOOR_BF16)
    return row["tok_s"] if row else None


def plot(rows: list[dict], out: str | Path) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit(
            "plot_benchmarks.py needs matplotlib: pip install matplotlib "
            "(or pip install -e '.[bench]')"
        )
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    shapes = latest(rows)
    fig, axes = plt.subplots(1, len(shapes), figsize=(2.6 * len(shapes) + 0.6, 4.6), squeeze=False)
    for ax, (shape, (device, figures)) in zip(axes[0], shapes.items()):
        present = [s for s in SYSTEMS if s in figures]
        top = max([figures[s]["tok_s"] for s in present] + [1.0])
        for name, style in ((FLOOR_BF16, "--"), (FLOOR_FP8, ":")):
            if name in figures:
                top = max(top, figures[name]["tok_s"])
        for x, system in enumerate(
            SYSTEMS
        ):  # a fixed slot per system, empty where none was measured
            if system not in figures:
                ax.text(x, top * 0.02, "n/a", ha="center", va="bottom", fontsize=8, color="#8c8c8c")
                continue
            value = figures[system]["tok_s"]
            ax.bar(x, value, width=0.75, color=SYSTEMS[system])
            ax.annotate(
                f"{value / 1000:.1f}k",
                (x, value),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=9,
            )
            floor = floor_of(system, figures)
            if floor:
                ax.text(
                    x,
                    value / 2,
                    f"{value / floor:.0%}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                    rotation=90,
                )
        for name, style in ((FLOOR_BF16, "--"), (FLOOR_FP8, ":")):
            if name in figures:
                floor = figures[name]["tok_s"]
                ax.axhline(floor, color="black", linestyle=style, linewidth=1.2)
                ax.annotate(
                    f"{floor / 1000:.1f}k",
                    (-0.55, floor),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="left",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_ylim(0, top * 1.12)
        ax.set_xlim(-0.6, len(SYSTEMS) - 0.4)
        ax.set_xticks([])
        ax.set_title(f"{shape}\n{device.removeprefix('NVIDIA ')}", fontsize=10)
        ax.yaxis.set_major_formatter(lambda v, _: f"{v / 1000:g}k")
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0][0].set_ylabel("output tokens / s")
    handles = [Patch(color=c, label=s) for s, c in SYSTEMS.items()]
    handles += [
        Line2D([], [], color="black", linestyle="--", label="memory floor, bf16 KV (decode)"),
        Line2D([], [], color="black", linestyle=":", label="memory floor, FP8 KV (decode)"),
    ]
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=len(handles),
        fontsize=9,
        frameon=False,
        bbox_to_anchor=(0.5, 0.995),
    )
    fig.suptitle(
        "bench.py workload (256 requests, 133,966 output tokens), latest recorded figures; "
        "in the bars: share of the memory floor for the bar's KV-cache dtype",
        fontsize=10,
        y=0.93,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.91))
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--csv", default=str(HERE / "benchmarks.csv"))
    parser.add_argument("--out", default=str(HERE / "benchmarks.png"))
    args = parser.parse_args()
    rows = read_rows(args.csv)
    if not rows:
        sys.exit(f"{args.csv}: no rows")
    plot(rows, args.out)
    print(f"wrote {args.out} ({len(latest(rows))} shapes)")


if __name__ == "__main__":
    main()
