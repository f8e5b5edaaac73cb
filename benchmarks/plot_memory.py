"""Peak GPU memory of a LoRA training step against context length, one line per provider: the rows of
bench_memory.py (benchmarks/results/memory.csv) drawn to docs/memory.png. Needs matplotlib (not a lorafuse
dependency: pip install matplotlib).

    python benchmarks/plot_memory.py                     # the newest run's rows -> docs/memory.png
    python benchmarks/plot_memory.py --csv DIR/memory.csv --out /tmp/memory.png
    python benchmarks/plot_memory.py --date 2026-11-29 --commit 9c1fdea
    python benchmarks/plot_memory.py --date 2026-11-29 --commit c2adf8d,2df3126   # a grid measured across commits

The newest run: the rows of the last row's date and commit (a grid split across several calls on one commit and
day is one run); --date / --commit pick another, --commit also several (comma-separated), the title naming them.
Where a provider and context appear more than once, the last row counts. x: tokens per step (batch x seq), log2
scale, ticked with the contexts; y: peak_GiB (max_memory_allocated). A provider that ran out of memory has its line
run on, dotted, to an x at the top of the axis over the first context it ran out at (bench_memory does not try its
longer ones); skipped and failed cells are left out, as are rows without a peak (CPU runs).
"""
import argparse
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSV = os.path.join(ROOT, "benchmarks", "results", "memory.csv")
PNG = os.path.join(ROOT, "docs", "memory.png")
MARKERS = "osD^v<>ph*"


def newest_run(rows, date=None, commits=None):
    """The rows of `date` and of `commits` (a list), by default the last row's date and commit; one row per
    (provider, context): the last."""
    chosen = [r for r in rows if date in (None, r["date"]) and (commits is None or r["commit"] in commits)]
    if not chosen:
        return []
    date, commits = chosen[-1]["date"], commits or [chosen[-1]["commit"]]
    cells = {(r["provider"], r["context"]): r for r in chosen if r["date"] == date and r["commit"] in commits}
    return list(cells.values())


def context_label(row):
    """The x tick of a row's context: 2k x4, 16k, 128k (bench_memory's table headings)."""
    batch, seq = int(row["batch"]), int(row["seq"])
    text = f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)
    return text if batch == 1 else f"{text} x{batch}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default=CSV, help=f"bench_memory's rows ({os.path.relpath(CSV, ROOT)})")
    parser.add_argument("--out", default=PNG, help=f"the image to write ({os.path.relpath(PNG, ROOT)})")
    parser.add_argument("--date", help="the run's date (default: the last row's)")
    parser.add_argument("--commit", help="the run's commit, or several, comma-separated (default: the last row's)")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_memory.py needs matplotlib: pip install matplotlib")

    with open(args.csv, newline="") as f:
        rows = newest_run(list(csv.DictReader(f)), args.date, args.commit and args.commit.split(","))
    measured = [r for r in rows if r["status"] == "ok" and r["peak_GiB"]]
    if not measured:
        sys.exit(f"{args.csv}: no row of that run has a peak (status ok, on a GPU)")
    top = max(float(r["peak_GiB"]) for r in measured) * 1.12

    fig, ax = plt.subplots(figsize=(9.5, 5))
    providers = list(dict.fromkeys(r["provider"] for r in rows))  # the order bench_memory ran them
    first_oom = {}  # provider: tokens of the first context it ran out of memory at
    for provider in providers:
        ooms = [int(r["tokens"]) for r in rows if r["provider"] == provider and r["status"].startswith("oom")]
        if ooms:
            first_oom[provider] = min(ooms)
    for i, provider in enumerate(providers):
        points = sorted((int(r["tokens"]), float(r["peak_GiB"])) for r in measured if r["provider"] == provider)
        if not points and provider not in first_oom:
            continue
        xs, ys = zip(*points) if points else ((), ())
        line, = ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], label=provider)
        if provider in first_oom:
            # the line runs on, dotted, to an x at the top over the context that ran out; providers that ran out at
            # the same context are spread a little sideways so that each x shows
            tokens = first_oom[provider]
            same = [p for p in providers if first_oom.get(p) == tokens]
            x = tokens * 2 ** (0.08 * (same.index(provider) - (len(same) - 1) / 2))
            if points:
                ax.plot([xs[-1], x], [ys[-1], top], linestyle=":", color=line.get_color())
            ax.plot([x], [top], linestyle="none", marker="x", markersize=9, markeredgewidth=2,
                    color=line.get_color(), clip_on=False)
    if first_oom:
        ax.plot([], [], linestyle=":", marker="x", color="gray", label="out of memory from there on")
    ticks = sorted({int(r["tokens"]): context_label(r) for r in rows}.items())
    ax.set_xscale("log", base=2)
    ax.set_xticks([t for t, _ in ticks], [text for _, text in ticks])
    ax.minorticks_off()
    ax.set_ylim(0, top)
    ax.set_xlabel("context: tokens per step (seq, x batch)")
    ax.set_ylabel("peak GiB (max_memory_allocated)")
    first = measured[0]
    commits = ", ".join(dict.fromkeys(r["commit"] for r in rows))
    model = {"llama1B": "Llama-3.2-1B shape"}.get(first["shape"], first["shape"])
    ax.set_title(f"LoRA r=16 training step, {model}: peak memory\n"
                 f"{first['gpu']}, torch {first['torch']}, {first['date']}, commits {commits}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=150)
    print(f"{args.out}: {len(measured)} points, {len(providers)} providers, run {first['date']} {commits}")


if __name__ == "__main__":
    main()
