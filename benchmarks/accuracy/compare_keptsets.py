#!/usr/bin/env python3
"""Compares two kvpolicy_keptsets outputs (runs A and B of one command line).

Reports how many kept sets, i.e. (prompt, regime, policy, budget, layer, KV head) rows, are
identical, and how many caches hash the same before and after compression. For every row that
differs it asks whether the difference is a near-tie, with each run's own numbers:
  score near-tie  P = tokens kept by A only, Q = tokens kept by B only. A ranked every p in P
                  above every q in Q by its scores; the margin is how far above, relative:
                  (max_P s_A - min_Q s_A) / max(|max_P s_A|, |min_Q s_A|), and the same with
                  B's scores (where one side is empty, a per-head budget moved, that side is
                  the run's cut). The tool lists every token within 1e-4 of a token on the
                  other side of its cut; a differing token missing from the lists is further.
  mass near-tie   ams cuts a row into segments where the cumulative attention mass reaches a
                  multiple of segment_mass; "mass_gap" is how close (relative) it comes to one.
                  A boundary that moves by one token moves a kept token with it.
A row is a near-tie when, in both runs, every differing token is within the score band and the
margin is at most --max-margin, or the mass gap is at most --max-margin.

  compare_keptsets.py A.json B.json [--expect-identical] [--expect-kv-identical]
                     [--max-margin X] [--show N]

Exit status 1 when a check asked for fails: --expect-identical, any kept set differs;
--expect-kv-identical, any cache differs (the ctest for 1 vs 2 threads uses both);
--max-margin X, a differing kept set is not a near-tie within X.
"""
import argparse
import collections
import json
import math
import re
import sys

BAND = 1e-4  # kvpolicy_keptsets' kBand


def load(path):
    with open(path) as f:
        j = json.load(f)
    if j.get("schema") != "kvpolicy-keptsets/1":
        sys.exit(f"{path}: not a kvpolicy_keptsets output (schema kvpolicy-keptsets/1)")
    return j


def kept_positions(hexbits):
    v = int(hexbits, 16)
    return {p for p in range(v.bit_length()) if v >> p & 1}


def score_of(x):
    return float(x) if not isinstance(x, str) else (math.inf if x == "inf" else -math.inf)


def rel(a, b):
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    scale = max(abs(a), abs(b))
    return (a - b) / scale if scale > 0 else 0.0


def margin(cut, mine, theirs):
    """The score margin in one run: `mine` are the tokens only this run kept, `theirs` those
    only the other run kept. Returns (value, exact); exact is False when a token lies outside
    the listed band (the value is then a lower bound) or there are no scores."""
    if not cut or not cut["lo"] or not cut["hi"]:
        return None, False
    lo = {p: score_of(s) for p, s in cut["lo"]}  # kept tokens next to the cut
    hi = {p: score_of(s) for p, s in cut["hi"]}  # evicted tokens next to the cut
    exact = all(p in lo for p in mine) and all(q in hi for q in theirs) and cut.get("full", True)
    # A token beyond its list is further from the cut than the list's far end.
    top_mine = max((lo.get(p, max(lo.values())) for p in mine), default=score_of(cut["lo"][0][1]))
    low_theirs = min((hi.get(q, min(hi.values())) for q in theirs),
                     default=score_of(cut["hi"][0][1]))
    return rel(top_mine, low_theirs), exact


def num(x):
    return "n/a" if x is None else f"{x:.3g}"


def key(s):
    return (s["task"], s["index"], s["regime"], s["policy"], s["budget"])


def short(policy):
    """A policy spec without the profile's directory."""
    return re.sub(r"profile=[^,)]*/", "profile=", policy)


def describe(j):
    b = j["build"]
    return (f"{b['vector_bits']}-bit vectors, FMA {'on' if b['fma'] else 'off'}, "
            f"{j['threads']} thread(s), Eigen SIMD: {b['eigen_simd']}")


def classify(d, limit):
    """'score' or 'mass' for a near-tie within `limit`, else None."""
    if d["exact"] and max(d["ma"], d["mb"]) <= limit:
        return "score"
    ga, gb = d["mass_a"], d["mass_b"]
    if ga is not None and gb is not None and max(ga, gb) <= limit:
        return "mass"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--expect-identical", action="store_true",
                    help="exit 1 if any kept set differs")
    ap.add_argument("--expect-kv-identical", action="store_true",
                    help="exit 1 if any cache (K/V, packed bytes, accumulators) differs")
    ap.add_argument("--max-margin", type=float, default=None,
                    help="exit 1 if a differing kept set is not a near-tie within this margin")
    ap.add_argument("--show", type=int, default=10, help="differing rows to list (default 10)")
    args = ap.parse_args()
    A, B = load(args.a), load(args.b)
    ca, cb = dict(A["config"]), dict(B["config"])
    ca.pop("margins", None), cb.pop("margins", None)
    if ca != cb:
        sys.exit("the two runs have different configurations; compare runs of one command line")
    print(f"A: {args.a}: {describe(A)}")
    print(f"B: {args.b}: {describe(B)}")

    sb = {key(s): s for s in B["sets"]}
    n = collections.Counter()
    kv_differs, by_policy, rows_by_policy = (collections.Counter() for _ in range(3))
    diffs = []
    for s in A["sets"]:
        t = sb.get(key(s))
        if t is None:
            sys.exit(f"run B has no set {key(s)}")
        n["sets"] += 1
        n["same_sets"] += s["digest"] == t["digest"]
        n["same_prefill"] += s["prefill_kv_digest"] == t["prefill_kv_digest"]
        n["same_kv"] += s["kv_digest"] == t["kv_digest"]
        if s["kv_digest"] != t["kv_digest"]:
            kv_differs[s["policy"]] += 1
        for ra, rb in zip(s["rows"], t["rows"], strict=True):
            n["rows"] += 1
            rows_by_policy[s["policy"]] += 1
            if "cut" in ra and "cut" in rb:
                n["cut_rows"] += 1
                n["same_cut"] += ra["cut"] == rb["cut"]
            if ra["kept"] == rb["kept"]:
                n["same_rows"] += 1
                continue
            by_policy[s["policy"]] += 1
            ka, kb = kept_positions(ra["kept"]), kept_positions(rb["kept"])
            P, Q = ka - kb, kb - ka
            ma, ea = margin(ra.get("cut"), P, Q)
            mb, eb = margin(rb.get("cut"), Q, P)
            diffs.append({"set": key(s), "l": ra["l"], "h": ra["h"], "P": sorted(P),
                          "Q": sorted(Q), "ma": ma, "mb": mb, "exact": ea and eb,
                          "mass_a": (ra.get("cut") or {}).get("mass_gap"),
                          "mass_b": (rb.get("cut") or {}).get("mass_gap")})

    print(f"sets (prompt, regime, policy, budget): {n['sets']}; full caches before compression "
          f"bit-identical: {n['same_prefill']}; kept sets identical in every row: "
          f"{n['same_sets']}; compressed caches bit-identical: {n['same_kv']}")
    if kv_differs:
        print("sets whose compressed caches differ, per policy: " +
              ", ".join(f"{short(p)}: {c}" for p, c in sorted(kv_differs.items())))
    print(f"kept sets (layer, KV head): {n['rows']} compared, {n['same_rows']} identical, "
          f"{n['rows'] - n['same_rows']} differ")
    if n["cut_rows"]:
        print(f"rows whose scores next to the cut are bit-identical: {n['same_cut']} of "
              f"{n['cut_rows']}")
    limit = args.max_margin if args.max_margin is not None else BAND
    if diffs:
        print("differing kept sets per policy:")
        for p, c in sorted(by_policy.items(), key=lambda x: -x[1]):
            print(f"  {short(p)}: {c} of {rows_by_policy[p]}")
        kinds = collections.Counter(classify(d, limit) for d in diffs)
        score = sorted(max(d["ma"], d["mb"]) for d in diffs if classify(d, limit) == "score")
        if score:
            print(f"score near-ties (every differing token within {BAND:g} of the cut in both "
                  f"runs, margin <= {limit:g}): {len(score)} rows; margin (relative, the larger "
                  f"of the two runs' views) median {score[len(score) // 2]:.3g}, max "
                  f"{score[-1]:.3g}")
        mass = sorted(max(d["mass_a"], d["mass_b"]) for d in diffs if classify(d, limit) == "mass")
        if mass:
            print(f"ams segment-boundary near-ties (cumulative mass within {limit:g} of a "
                  f"segment target in both runs): {len(mass)} rows; mass gap max {mass[-1]:.3g}")
        if kinds[None]:
            print(f"not near-ties within {limit:g}: {kinds[None]} rows")
        size = collections.Counter(len(d["P"]) + len(d["Q"]) for d in diffs)
        print("tokens that differ per differing row: " +
              ", ".join(f"{k}: {v} rows" for k, v in sorted(size.items())))
        order = sorted(diffs, key=lambda d: (classify(d, limit) is not None,
                                             -max(d["ma"] or 0.0, d["mb"] or 0.0)))
        for d in order[:args.show]:
            task, idx, regime, pol, bud = d["set"]
            kind = classify(d, limit) or "no near-tie"
            mass_gap = ("" if d["mass_a"] is None else
                        f", mass gap A {num(d['mass_a'])}, B {num(d['mass_b'])}")
            print(f"  {task} #{idx} {regime} {short(pol)} @ {bud} layer {d['l']} head {d['h']}: "
                  f"A only {d['P']}, B only {d['Q']}; score margin A {num(d['ma'])}, "
                  f"B {num(d['mb'])}{'' if d['exact'] else ' (at least)'}{mass_gap}: {kind}")
    # Near-ties in A: how many rows a perturbation of a given relative size could change.
    gaps = [r["cut"]["gap"] for s in A["sets"] for r in s["rows"]
            if "cut" in r and r["cut"].get("gap") is not None]
    if gaps:
        print("rows of A by the smallest relative score difference between a kept and an "
              "evicted token: " +
              ", ".join(f"<= {x:g}: {sum(g <= x for g in gaps)}"
                        for x in (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3)) + f" (of {len(gaps)})")

    failures = []
    if args.expect_identical and n["same_rows"] != n["rows"]:
        failures.append(f"{n['rows'] - n['same_rows']} kept sets differ")
    if args.expect_kv_identical and (n["same_kv"] != n["sets"] or n["same_prefill"] != n["sets"]):
        failures.append(f"{n['sets'] - n['same_kv']} compressed and "
                        f"{n['sets'] - n['same_prefill']} full caches differ")
    if args.max_margin is not None:
        wide = sum(classify(d, limit) is None for d in diffs)
        if wide:
            failures.append(f"{wide} differing kept sets are not near-ties within {limit:g}")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
