"""Bar chart of bench.py throughput per version, from benchmarks.csv (the BENCHMARKS.md figures).

    python plot_benchmarks.py                       # benchmarks.csv -> benchmarks.png (H100 rows)
    python plot_benchmarks.py --device "NVIDIA H200" --out h200.png

One bar per CSV row of the chosen device: the median tok/s, with the runs' min-max as error bars.
Grey bars are the original nano-vllm's rows (versions starting "original"); horizontal lines mark the
original's side-by-side median (the row whose version is "original") and,
where known for the device, the memory floor. Needs matplotlib (``pip install matplotlib``, or the
``bench`` extra); the library itself does not.
"""
import argparse
import csv
import sys
import textwrap

# bench.py workload's memory floor (SPEC §6): decode reads 13.85 TB of KV plus the weights, at the
# measured 3.06 TB/s, plus prefill: about 5.3 s, about 25,000 tok/s for the 133,966 output tokens.
FLOORS = {"NVIDIA H100 80GB HBM3": (25_000, "bf16 memory floor (~5.3 s)")}
COLUMNS = ("version", "label", "tok_s_median", "tok_s_min", "tok_s_max", "device", "date", "commit")


def read_rows(path: str, device: str | None = None) -> list[dict]:
    """The CSV's rows in file order (those of ``device`` when given), throughputs as floats."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {', '.join(sorted(missing))}")
        rows = []
        for row in reader:
            if device is not None and row["device"] != device:
                continue
            for key in ("tok_s_median", "tok_s_min", "tok_s_max"):
                row[key] = float(row[key])
            if not row["tok_s_min"] <= row["tok_s_median"] <= row["tok_s_max"]:
                raise ValueError(f"{path}: {row['version']}: need min <= median <= max")
            rows.append(row)
    return rows


def plot(rows: list[dict], out: str, device: str) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_benchmarks.py needs matplotlib: pip install matplotlib (or pip install -e '.[bench]')")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import StrMethodFormatter

    medians = [r["tok_s_median"] for r in rows]
    errors = [[r["tok_s_median"] - r["tok_s_min"] for r in rows], [r["tok_s_max"] - r["tok_s_median"] for r in rows]]
    names = [textwrap.fill(r["label"], 20, break_on_hyphens=False) + (f"\n{r['commit']}" if r["commit"] else "") for r in rows]
    colors = ["tab:gray" if r["version"].startswith("original") else "tab:blue" for r in rows]

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 5.5))
    x = range(len(rows))
    ax.bar(x, medians, yerr=errors, capsize=4, color=colors, width=0.6)
    for i, m in enumerate(medians):
        ax.annotate(f"{m:,.0f}", (i, rows[i]["tok_s_max"]), xytext=(0, 4), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)
    top = max(r["tok_s_max"] for r in rows)
    original = next((r for r in rows if r["version"] == "original"), None)
    if original is not None:
        ax.axhline(original["tok_s_median"], color="tab:gray", linestyle="--", linewidth=1,
                   label=f"original nano-vllm: {original['tok_s_median']:,.0f} tok/s")
    if device in FLOORS:
        floor, what = FLOORS[device]
        ax.axhline(floor, color="tab:red", linestyle=":", linewidth=1.5, label=f"{what}: {floor:,.0f} tok/s")
        top = max(top, floor)
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("output tokens / s (median; bars: min-max of runs)")
    ax.set_title(f"bench.py (Qwen3-0.6B shape, 256 requests, 133,966 tokens) on {device}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default="benchmarks.csv")
    parser.add_argument("--out", default="benchmarks.png")
    parser.add_argument("--device", default="NVIDIA H100 80GB HBM3", help="plot the rows of this device")
    args = parser.parse_args()
    rows = read_rows(args.csv, args.device)
    if not rows:
        sys.exit(f"{args.csv}: no rows for device {args.device!r}")
    plot(rows, args.out, args.device)
    print(f"wrote {args.out} ({len(rows)} versions on {args.device})")


if __name__ == "__main__":
    main()
