#!/usr/bin/env python3
"""Checks the paired comparisons in kvpolicy_accuracy's results.json.

usage: check_paired.py RESULTS_JSON

Fidelity: summary.fidelity_paired must hold, for every policy after the first and every budget,
the mean over the same windows of its KL minus the first policy's KL, with n = the windows.

Long generation: from the raw records (every generation's per-block KL of every (policy, budget) cell), recomputes
what summary.long_paired must hold: one entry per cell whose policy is not the first long policy,
paired with the first policy's cell at the same budget; its mean difference over the
concatenated blocks of all generations and its per-block mean over generations. The bootstrap
interval must contain the mean, and "separated" must say whether it excludes zero. Exits 1 with
the first mismatch.
"""
import json
import sys


def fail(message):
    raise AssertionError("check_paired: " + message)


def check_interval(k, d, separated):
    lo, hi = d["ci"]
    if not lo <= d["mean"] <= hi:
        fail("%r: interval [%r, %r] does not contain the mean %r" % (k, lo, hi, d["mean"]))
    if separated != (lo > 0 or hi < 0):
        fail("%r: separated=%r with interval [%r, %r]" % (k, separated, lo, hi))


def check_fidelity(results):
    windows = results["records"]["fidelity"]
    policies = results["config"]["policies"]
    if not windows or len(policies) < 2:
        fail("no fidelity records or fewer than 2 policies: the check would be empty")
    kl = {}
    for w in windows:
        for c in w["cells"]:
            kl.setdefault((c["policy"], c["budget"]), []).append(c["kl"])
    expected = {}
    for (p, b), v in kl.items():
        if p != policies[0]:
            base = kl[(policies[0], b)]
            expected[(p, b)] = (sum(x - y for x, y in zip(v, base)) / len(v), len(v))
    got = results["summary"].get("fidelity_paired")
    if got is None:
        fail("summary has no fidelity_paired")
    keys = [(e["policy"], e["budget"]) for e in got]
    if len(set(keys)) != len(keys) or set(keys) != set(expected):
        fail("fidelity pairs %r, expected one each of %r" % (keys, sorted(expected)))
    for e in got:
        k = (e["policy"], e["budget"])
        mean, n = expected[k]
        d = e["kl_diff"]
        if e["baseline"] != policies[0]:
            fail("%r is paired with %r, not the first policy %r" % (k, e["baseline"], policies[0]))
        if abs(d["mean"] - mean) > 1e-12 * max(1.0, abs(mean)) or d["n"] != n:
            fail("%r: mean %r over %r windows, recomputed %r over %d" % (k, d["mean"], d["n"], mean, n))
        check_interval(k, d, e["separated"])
    return len(got)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        results = json.load(f)
    nf = check_fidelity(results)
    gens = results["records"]["long"]
    if not gens:
        fail("no long-generation records")
    cells = gens[0]["cells"]
    base = cells[0]["policy"]
    expected = {}
    for i, c in enumerate(cells):
        if c["policy"] == base:
            continue
        j = [k for k, d in enumerate(cells) if d["policy"] == base and d["budget"] == c["budget"]]
        if not j:
            continue
        diffs, curve = [], []
        for g in gens:
            a, b = g["cells"][i]["kl_bins"], g["cells"][j[0]]["kl_bins"]
            if g["cells"][i]["policy"] != c["policy"] or g["cells"][i]["budget"] != c["budget"]:
                fail("generation %r lists its cells in another order" % g["prompt"])
            if len(a) != len(b):
                break  # the report leaves such a pair out
            diffs += [x - y for x, y in zip(a, b)]
            curve += [0.0] * (len(a) - len(curve))
            for q, (x, y) in enumerate(zip(a, b)):
                curve[q] += (x - y) / len(gens)
        else:
            expected[(c["policy"], c["budget"])] = (sum(diffs) / len(diffs), curve, len(diffs))
    got = results["summary"].get("long_paired")
    if got is None:
        fail("summary has no long_paired")
    if not expected:
        fail("the run has no policy to pair with %r: the check would be empty" % base)
    keys = [(e["policy"], e["budget"]) for e in got]
    if len(set(keys)) != len(keys) or set(keys) != set(expected):
        fail("paired entries %r, expected one each of %r" % (keys, sorted(expected)))
    for e in got:
        k = (e["policy"], e["budget"])
        if e["baseline"] != base:
            fail("%r is paired with %r, not the first policy %r" % (k, e["baseline"], base))
        mean, curve, n = expected[k]
        d = e["kl_diff"]
        if d["n"] != n:
            fail("%r: n=%r, but the generations have %d paired blocks" % (k, d["n"], n))
        if abs(d["mean"] - mean) > 1e-12 * max(1.0, abs(mean)):
            fail("%r: mean difference %r, recomputed %r" % (k, d["mean"], mean))
        check_interval(k, d, e["separated"])
        if len(e["kl_diff_curve"]) != len(curve) or any(
                abs(x - y) > 1e-12 for x, y in zip(e["kl_diff_curve"], curve)):
            fail("%r: per-block differences %r, recomputed %r" % (k, e["kl_diff_curve"], curve))
    print("check_paired: %d fidelity and %d long-generation pairs against the first policy match "
          "the raw records" % (nf, len(got)))


if __name__ == "__main__":
    main()
