"""Plot ``e2e.json`` from ``bench_e2e``: decode tokens/s per backend, and % of the bandwidth roofline.

    python -m benchmarks.plot_e2e path/to/e2e.json [benchmarks/e2e.png]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    data = json.load(open(sys.argv[1]))
    out = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/e2e.png"
    contexts = sorted({r["context"] for r in data["rows"]})
    fig, axes = plt.subplots(2, len(contexts), figsize=(4.5 * len(contexts), 7), squeeze=False)
    for col, context in enumerate(contexts):
        for backend in dict.fromkeys(r["backend"] for r in data["rows"]):
            rows = sorted((r for r in data["rows"] if r["backend"] == backend and r["context"] == context),
                          key=lambda r: r["batch"])
            if not rows:
                continue
            batches = [r["batch"] for r in rows]
            axes[0, col].plot(batches, [r["tokens_per_s"] for r in rows], marker="o", label=backend)
            axes[1, col].plot(batches, [100 * r["roofline_share"] for r in rows], marker="o", label=backend)
        axes[0, col].set_title(f"context {context}")
        for row, ylabel in ((0, "decode tokens/s"), (1, "% of bandwidth roofline")):
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].set_xlabel("batch")
            axes[row, col].set_ylabel(ylabel)
            axes[row, col].grid(True, alpha=0.3)
        axes[0, col].set_yscale("log")
    axes[0, 0].legend()
    fig.suptitle(f"{data['device']}: Llama-3-8B-shaped decode step, {data['layers']} layers "
                 f"(copy bandwidth {data['bandwidth'] / 1e12:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
