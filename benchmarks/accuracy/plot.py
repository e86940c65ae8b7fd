#!/usr/bin/env python3
"""Plots of kvpolicy_accuracy's results.json (matplotlib; Debian: python3-matplotlib).

usage: plot.py RESULTS_JSON OUT_DIR

Writes, for the sections present:
  passkey_full_cache.png   full-cache passkey accuracy vs prompt length
  passkey_grid.png         passkey accuracy vs budget, one line per policy
  fidelity_kl.png          mean KL(full || policy) vs budget, one line per policy
  fidelity_top1.png        top-1 agreement with the full cache vs budget
  decode.png               decode-time token agreement vs budget (tokens per KV head)
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def by_policy(rows, x_key, y_key):
    lines = {}
    for r in rows:
        lines.setdefault(r["policy"], []).append((r[x_key], r[y_key]))
    return {p: sorted(v) for p, v in lines.items()}


def budget_plot(path, title, ylabel, lines, full=None, percent_y=False, xlabel="budget (kept fraction of the prompt)",
                percent_x=True):
    fig, ax = plt.subplots(figsize=(9.0, 4.4), dpi=120)
    markers = "osD^v<>pX*h"
    for i, (policy, pts) in enumerate(lines.items()):
        xs = [x * 100 if percent_x else x for x, _ in pts]
        ys = [y * 100 if percent_y else y for _, y in pts]
        ax.plot(xs, ys, marker=markers[i % len(markers)], label=policy, alpha=0.85)
    if full is not None:
        ax.axhline(full * 100 if percent_y else full, color="black", linestyle="--", linewidth=1,
                   label="full cache")
    ax.set_title(title)
    ax.set_xlabel(xlabel + (" (%)" if percent_x else ""))
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        res = json.load(f)
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    written = []
    model = res.get("model", "")

    pk = res.get("passkey")
    if pk:
        lengths = sorted({r["length"] for r in pk["full_cache"]})
        acc = []
        for L in lengths:
            rows = [r for r in pk["full_cache"] if r["length"] == L]
            acc.append(100.0 * sum(r["correct"] for r in rows) / len(rows))
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
        ax.plot(lengths, acc, marker="o", color="black")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths)
        ax.set_xticklabels([str(L) for L in lengths])
        ax.set_ylim(-5, 105)
        ax.axhline(90, color="gray", linestyle=":", linewidth=1)
        ax.set_title(f"Passkey, full cache ({model})")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("accuracy (%)")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out, "passkey_full_cache.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
        grid_rows = [r for r in pk["full_cache"] if r["length"] == pk["grid_length"]]
        full = sum(r["correct"] for r in grid_rows) / len(grid_rows) if grid_rows else None
        written.append(budget_plot(os.path.join(out, "passkey_grid.png"),
                                   f"Passkey at {pk['grid_length']} tokens", "accuracy (%)",
                                   by_policy(pk["grid"], "budget", "accuracy"), full, percent_y=True))

    fid = res.get("fidelity")
    if fid:
        written.append(budget_plot(os.path.join(out, "fidelity_kl.png"),
                                   "Teacher-forced fidelity: KL(full || policy)", "mean KL (nats)",
                                   by_policy(fid["grid"], "budget", "kl")))
        written.append(budget_plot(os.path.join(out, "fidelity_top1.png"),
                                   "Teacher-forced fidelity: top-1 agreement", "agreement (%)",
                                   by_policy(fid["grid"], "budget", "top1"), 1.0, percent_y=True))

    dec = res.get("decode")
    if dec and dec["cells"]:
        written.append(budget_plot(os.path.join(out, "decode.png"),
                                   f"Decode-time compression ({dec['generated']} generated tokens)",
                                   "token agreement (%)",
                                   by_policy(dec["cells"], "budget_tokens", "agreement"), 1.0,
                                   percent_y=True, xlabel="budget (tokens per KV head)",
                                   percent_x=False))
    for p in written:
        print(f"plot: wrote {p}", file=sys.stderr)


if __name__ == "__main__":
    main()
