#!/usr/bin/env python3
"""Checks the paired comparisons in kvpolicy_accuracy's results.json.

usage: check_paired.py RESULTS_JSON

Recomputes from the raw records what the summary's pairings with the first policy must hold:
- summary.fidelity_paired: for every policy after the first and every budget, its KL minus the
  first policy's over the same windows;
- summary.long_paired: one entry per cell whose policy is not the first long policy, paired with
  the first policy's cell at the same budget over the concatenated blocks of all generations,
  and the per-block mean difference over generations.
Each entry's mean and n, and its bootstrap interval exactly (stats.cpp's mt19937_64 draws, seed 1,
the config's resamples, the same arithmetic), so pairs that are misaligned fail; "separated"
must say whether the interval excludes zero. A run with neither section, or with a section and
nothing to pair, fails. Exits 1 with the first mismatch.
"""
import json
import sys


def fail(message):
    raise AssertionError("check_paired: " + message)


MASK = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64, for the report's bootstrap index draws."""

    def __init__(self, seed):
        self.mt = [seed & MASK]
        for i in range(1, 312):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & MASK)
        self.i = 312

    def __call__(self):
        if self.i >= 312:
            mt = self.mt
            for k in range(312):
                x = (mt[k] & ~0x7FFFFFFF & MASK) | (mt[(k + 1) % 312] & 0x7FFFFFFF)
                mt[k] = mt[(k + 156) % 312] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
            self.i = 0
        y = self.mt[self.i]
        self.i += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & MASK


def percentile(xs, q):
    h = q * (len(xs) - 1)
    j = int(h // 1)
    if j + 1 >= len(xs):
        return xs[-1]
    return xs[j] + (h - j) * (xs[j + 1] - xs[j])


def paired_interval(diffs, resamples, seed=1):
    """benchmarks/accuracy/stats.cpp's paired_bootstrap: the same draws and arithmetic."""
    x0 = diffs[0]
    d = [x - x0 for x in diffs]
    n = len(d)
    if n == 1:
        return [x0, x0]
    rng = MT19937_64(seed)
    means = []
    for _ in range(resamples):
        s = 0.0
        for _ in range(n):
            s += d[(rng() >> 11) % n]
        means.append(x0 + s / n)
    means.sort()
    return [percentile(means, 0.025), percentile(means, 0.975)]


def check_interval(k, d, separated, diffs, resamples):
    lo, hi = d["ci"]
    want = paired_interval(diffs, resamples)
    if [lo, hi] != want:
        fail("%r: interval [%r, %r], recomputed from the pairs %r" % (k, lo, hi, want))
    if separated != (lo > 0 or hi < 0):
        fail("%r: separated=%r with interval [%r, %r]" % (k, separated, lo, hi))


def check_fidelity(results, resamples):
    windows = results["records"]["fidelity"]
    policies = results["config"]["policies"]
    if not windows:
        return 0
    if len(policies) < 2:
        fail("fewer than 2 policies: the fidelity check would be empty")
    kl = {}
    for w in windows:
        for c in w["cells"]:
            kl.setdefault((c["policy"], c["budget"]), []).append(c["kl"])
    expected = {}
    for (p, b), v in kl.items():
        if p != policies[0]:
            base = kl[(policies[0], b)]
            diffs = [x - y for x, y in zip(v, base)]
            expected[(p, b)] = (sum(diffs) / len(v), len(v), diffs)
    got = results["summary"].get("fidelity_paired")
    if got is None:
        fail("summary has no fidelity_paired")
    keys = [(e["policy"], e["budget"]) for e in got]
    if len(set(keys)) != len(keys) or set(keys) != set(expected):
        fail("fidelity pairs %r, expected one each of %r" % (keys, sorted(expected)))
    for e in got:
        k = (e["policy"], e["budget"])
        mean, n, diffs = expected[k]
        d = e["kl_diff"]
        if e["baseline"] != policies[0]:
            fail("%r is paired with %r, not the first policy %r" % (k, e["baseline"], policies[0]))
        if abs(d["mean"] - mean) > 1e-12 * max(1.0, abs(mean)) or d["n"] != n:
            fail("%r: mean %r over %r windows, recomputed %r over %d" % (k, d["mean"], d["n"], mean, n))
        check_interval(k, d, e["separated"], diffs, resamples)
    return len(got)


def check_long(results, resamples):
    gens = results["records"]["long"]
    if not gens:
        return 0
    cells = gens[0]["cells"]
    base = cells[0]["policy"]
    expected, diffs_of = {}, {}
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
            diffs_of[(c["policy"], c["budget"])] = diffs
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
        check_interval(k, d, e["separated"], diffs_of[k], resamples)
        if len(e["kl_diff_curve"]) != len(curve) or any(
                abs(x - y) > 1e-12 for x, y in zip(e["kl_diff_curve"], curve)):
            fail("%r: per-block differences %r, recomputed %r" % (k, e["kl_diff_curve"], curve))
    return len(got)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        results = json.load(f)
    resamples = results["config"]["resamples"]
    nf = check_fidelity(results, resamples)
    nl = check_long(results, resamples)
    if nf + nl == 0:
        fail("no paired entry to check (no fidelity or long-generation records)")
    print("check_paired: %d fidelity and %d long-generation pairs against the first policy match "
          "the raw records" % (nf, nl))


if __name__ == "__main__":
    main()
