#!/usr/bin/env python3
"""Checks that kvpolicy_accuracy's --shard/--merge reproduce one run exactly.

usage: check_merge.py SINGLE_RESULTS_JSON MERGED_RESULTS_JSON

The two results must hold the same raw records (after sorting, as the report sorts them) and the
same summary (every aggregate, interval and paired comparison), compared exactly: sharding must
not change a single number. Exits 1 with the first difference otherwise.
"""
import json
import sys


def key(section, r):
    if section == "retrieval":
        return (r["task"], r["length"], r["index"])
    if section == "fidelity":
        return (r["source"], r["window"])
    return (r["prompt"],)


def first_difference(a, b, path="$"):
    if type(a) is not type(b):
        return "%s: %r != %r" % (path, a, b)
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return "%s: keys %s != %s" % (path, sorted(a), sorted(b))
        for k in a:
            d = first_difference(a[k], b[k], "%s.%s" % (path, k))
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return "%s: %d items != %d" % (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, "%s[%d]" % (path, i))
            if d:
                return d
        return None
    return None if a == b else "%s: %r != %r" % (path, a, b)


def assert_true(cond, message):
    if not cond:
        raise AssertionError(message)


def assert_same(a, b, what):
    """Raises AssertionError (exit 1) with the first difference between a and b."""
    d = first_difference(a, b, what)
    if d:
        raise AssertionError("check_merge: %s differ: %s" % (what, d))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        single = json.load(f)
    with open(sys.argv[2]) as f:
        merged = json.load(f)
    assert_true(len(merged["shards"]) >= 2,
                "check_merge: %s is not a merge of several shards" % sys.argv[2])
    counts = {}
    for section in ("retrieval", "fidelity", "long"):
        a = sorted(single["records"][section], key=lambda r: key(section, r))
        b = sorted(merged["records"][section], key=lambda r: key(section, r))
        counts[section] = len(a)
        assert_same(a, b, "records." + section)
    assert_same(single["summary"], merged["summary"], "summary")
    assert_true(any(counts.values()), "check_merge: no records to compare")
    print("check_merge: %d shards merged = one run (%s records, summary identical)"
          % (len(merged["shards"]), ", ".join("%d %s" % (n, s) for s, n in counts.items())))


if __name__ == "__main__":
    main()
