#!/usr/bin/env python3
"""Plots of kvpolicy_accuracy's results.json (matplotlib; Debian: python3-matplotlib), with the
report's 95% intervals as error bars. Reads only results["summary"] (written by the report).

usage: plot.py RESULTS_JSON OUT_DIR

Writes, for the sections present:
  retrieval_full_cache.png       full-cache exact match per task vs prompt length (Wilson CI)
  retrieval_<regime>.png         answer log-probability change vs budget, all tasks pooled,
                                 one line per policy (bootstrap CI), per regime
  fidelity_kl.png                mean KL(full || policy) vs budget (bootstrap CI)
  long_generation.png            mean KL per block of generated tokens, per policy and budget
"""
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MARKERS = "osD^v<>pX*h"


def label(spec):
    # The bundled profile's folder is noise in a legend.
    return re.sub(r"profile=[^,)]*/", "profile=", spec)


def errorbar_lines(ax, lines, percent_y=False, percent_x=True):
    """lines: {name: [(x, mean, lo, hi)]}"""
    for i, (name, pts) in enumerate(lines.items()):
        pts = sorted(pts)
        scale_y = 100 if percent_y else 1
        xs = [p[0] * (100 if percent_x else 1) for p in pts]
        ys = [p[1] * scale_y for p in pts]
        lo = [(p[1] - p[2]) * scale_y for p in pts]
        hi = [(p[3] - p[1]) * scale_y for p in pts]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker=MARKERS[i % len(MARKERS)], capsize=3,
                    label=label(name), alpha=0.85)


def finish(fig, ax, path, title, xlabel, ylabel):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print("wrote", path)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        results = json.load(f)
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    summary = results.get("summary", {})

    curve = summary.get("curve", [])
    if curve:
        lines = {}
        for c in curve:
            em = c["em"]
            lines.setdefault(c["task"], []).append((c["length"], em["rate"], em["ci"][0], em["ci"][1]))
        fig, ax = plt.subplots(figsize=(12.0, 4.6), dpi=120)
        errorbar_lines(ax, lines, percent_y=True, percent_x=False)
        ax.axhline(90, color="black", linestyle="--", linewidth=1, label="90%")
        finish(fig, ax, os.path.join(out, "retrieval_full_cache.png"),
               "Full cache: exact match vs prompt length", "prompt length (tokens)",
               "exact match (%)")

    pooled = summary.get("retrieval", {}).get("all", [])
    for regime in sorted({c["regime"] for c in pooled}):
        lines = {}
        for c in pooled:
            if c["regime"] == regime:
                d = c["dlogp"]
                lines.setdefault(c["policy"], []).append((c["budget"], d["mean"], d["ci"][0], d["ci"][1]))
        fig, ax = plt.subplots(figsize=(12.0, 4.6), dpi=120)
        errorbar_lines(ax, lines)
        ax.axhline(0, color="black", linestyle="--", linewidth=1, label="full cache")
        name = "question-known" if regime == "known" else "question-agnostic"
        finish(fig, ax, os.path.join(out, "retrieval_%s.png" % regime),
               "Retrieval, %s (all tasks): answer log-probability change" % name,
               "budget (kept fraction, %)", "change of log p(answer), nats")

    fid = summary.get("fidelity", [])
    if fid:
        lines = {}
        for c in fid:
            k = c["kl"]
            lines.setdefault(c["policy"], []).append((c["budget"], k["mean"], k["ci"][0], k["ci"][1]))
        fig, ax = plt.subplots(figsize=(12.0, 4.6), dpi=120)
        errorbar_lines(ax, lines)
        ax.set_yscale("log")
        finish(fig, ax, os.path.join(out, "fidelity_kl.png"), "Teacher-forced fidelity",
               "budget (kept fraction, %)", "mean KL(full || policy), nats")

    long_rows = summary.get("long", [])
    if long_rows:
        recs = results.get("records", {}).get("long", [])
        block = recs[0]["bin"] if recs else 1
        fig, ax = plt.subplots(figsize=(12.0, 4.6), dpi=120)
        for i, c in enumerate(long_rows):
            xs = [b * block for b in range(len(c["kl_curve"]))]
            ax.plot(xs, c["kl_curve"], marker=MARKERS[i % len(MARKERS)], markersize=3,
                    label="%s @ %d" % (label(c["policy"]), c["budget"]), alpha=0.85)
        ax.set_yscale("symlog", linthresh=1e-3)
        finish(fig, ax, os.path.join(out, "long_generation.png"),
               "Long generation: KL per block of generated tokens",
               "generated token (block start)", "mean KL(full || policy), nats")


if __name__ == "__main__":
    main()
