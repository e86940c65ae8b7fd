"""`kvpolicy compress` end to end: numpy writes small K/V/Q as .npy files, the built binary runs
(its path in $KVPOLICY_CLI), and the test checks the files it wrote against hand-computed kept
sets (knorm, streaming) and, where the package is installed (marker `binding`), against the
Python binding kvpolicy.Policy(spec).select on the same arrays; then the report and every error:
the message names the file or option and the problem, and the output directory gets nothing."""

import json
import os
import re

import numpy as np
import pytest

OUTPUTS = {"indices.npy", "counts.npy", "keys.npy", "values.npy", "summary.json"}


def cache(rng, L=2, H=3, T=40, d=16, dtype=np.float32):
    k = rng.standard_normal((L, H, T, d)).astype(dtype)
    v = rng.standard_normal((L, H, T, d)).astype(dtype)
    return k, v


def save(tmp_path, name, a):
    p = tmp_path / name
    np.save(p, a)
    return str(p)


def knorm_reference(k, n):
    """knorm keeps the n keys with the smallest L2 norm per (layer, head), ascending."""
    norms = np.linalg.norm(k.astype(np.float64), axis=-1)
    return np.sort(np.argsort(norms, axis=-1, kind="stable")[..., :n], axis=-1)


def load_out(out):
    """The files of a successful run (and no others, no temporaries)."""
    assert set(os.listdir(out)) == OUTPUTS
    r = {n[:-4]: np.load(os.path.join(out, n)) for n in OUTPUTS if n.endswith(".npy")}
    with open(os.path.join(out, "summary.json")) as f:
        r["summary"] = json.load(f)
    return r


def check_gathered(r, k, v):
    """keys/values rows are the kept input rows, zeros past each count; indices -1 there."""
    idx, counts = r["indices"], r["counts"]
    assert idx.dtype == np.int64 and counts.dtype == np.int64
    assert r["keys"].dtype == k.dtype and r["values"].dtype == v.dtype
    width = idx.shape[-1]
    assert width == counts.max()
    assert r["keys"].shape == idx.shape + (k.shape[-1],)
    assert r["values"].shape == idx.shape + (v.shape[-1],)
    for row in np.ndindex(counts.shape):
        n = counts[row]
        kept = idx[row][:n]
        assert (np.diff(kept) > 0).all() and (idx[row][n:] == -1).all()
        np.testing.assert_array_equal(r["keys"][row][:n], k[row][kept])
        np.testing.assert_array_equal(r["values"][row][:n], v[row][kept])
        assert (r["keys"][row][n:] == 0).all() and (r["values"][row][n:] == 0).all()


def run_ok(cli, *args):
    p = cli("compress", *args)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    return p


def run_fail(cli, out, *args, subject, problem, code=1):
    """Runs a failing command: exit status `code`, one stderr line
    `kvpolicy compress: <subject>: ...` containing every string in `problem`, and no output
    directory left behind (or, if it existed, its contents untouched)."""
    before = sorted(os.listdir(out)) if os.path.isdir(out) else None
    p = cli("compress", *args)
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"kvpolicy compress: {subject}: "), lines[0]
    for s in [problem] if isinstance(problem, str) else problem:
        assert s in lines[0], (s, lines[0])
    if before is None:
        assert not os.path.exists(out), os.listdir(out)
    else:
        assert sorted(os.listdir(out)) == before
    return lines[0]


# ---- results ------------------------------------------------------------------------------------

def test_knorm_matches_numpy(cli, rng, tmp_path):
    k, v = cache(rng)
    out = str(tmp_path / "out")
    p = run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
               "--policy", "knorm", "--budget", "0.25", "--out", out)
    assert re.fullmatch(rf"kept 60 of 240 tokens \(25\.0%\) in [0-9.]+ s, written to {out}\n",
                        p.stdout), p.stdout
    r = load_out(out)
    ref = knorm_reference(k, 10)
    assert r["indices"].shape == (2, 3, 10)
    np.testing.assert_array_equal(r["indices"], ref)
    np.testing.assert_array_equal(r["counts"], np.full((2, 3), 10))
    check_gathered(r, k, v)

    s = r["summary"]
    assert s["schema"] == "kvpolicy-compress/1"
    assert s["policy"] == "knorm" and s["policy_arg"] == "knorm" and s["scorer"] == "knorm"
    assert s["allocators"] == []
    assert s["budget"] == {"kind": "ratio", "value": 0.25, "tokens_per_head": 10}
    assert s["inputs"]["keys"] == {"file": str(tmp_path / "k.npy"), "dtype": "float32",
                                   "shape": [2, 3, 40, 16]}
    assert s["inputs"]["values"]["shape"] == [2, 3, 40, 16]
    assert s["inputs"]["queries"] is None
    assert (s["input_rank"], s["layers"], s["kv_heads"], s["tokens"], s["head_dim"],
            s["value_dim"]) == (4, 2, 3, 40, 16, 16)
    assert s["q_heads"] is None and s["queries"] is None
    assert s["outputs"]["indices"] == {"file": "indices.npy", "dtype": "int64",
                                       "shape": [2, 3, 10]}
    assert s["outputs"]["counts"]["shape"] == [2, 3]
    assert s["outputs"]["keys"] == {"file": "keys.npy", "dtype": "float32",
                                    "shape": [2, 3, 10, 16]}
    assert s["kept"] == {"per_layer": [30, 30], "per_head": [[10] * 3] * 2, "total": 60,
                         "of": 240, "fraction": 0.25}
    t = s["seconds"]
    assert set(t) == {"read", "policy", "write", "total"}
    assert all(x >= 0 for x in t.values()) and t["total"] >= t["policy"]


def test_budget_tokens_3d_and_value_dim(cli, rng, tmp_path):
    """A 3-d cache is one layer (outputs without the layer axis); values may have their own
    head_dim; --budget-tokens keeps that many per head."""
    k = rng.standard_normal((3, 40, 16)).astype(np.float32)
    v = rng.standard_normal((3, 40, 8)).astype(np.float32)
    out = str(tmp_path / "out")
    run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
           "--policy", "knorm", "--budget-tokens", "7", "--out", out)
    r = load_out(out)
    assert r["indices"].shape == (3, 7) and r["counts"].shape == (3,)
    assert r["keys"].shape == (3, 7, 16) and r["values"].shape == (3, 7, 8)
    np.testing.assert_array_equal(r["indices"], knorm_reference(k, 7))
    check_gathered(r, k, v)
    s = r["summary"]
    assert s["input_rank"] == 3 and s["layers"] == 1 and s["value_dim"] == 8
    assert s["budget"] == {"kind": "tokens", "value": 7, "tokens_per_head": 7}
    assert s["outputs"]["indices"]["shape"] == [3, 7]
    assert s["kept"]["per_layer"] == [21] and s["kept"]["fraction"] == pytest.approx(21 / 120)


def test_budget_tokens_above_length_keeps_everything(cli, rng, tmp_path):
    k, v = cache(rng, T=12)
    out = str(tmp_path / "out")
    run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
           "--policy", "knorm", "--budget-tokens", "100", "--out", out)
    r = load_out(out)
    np.testing.assert_array_equal(r["indices"], np.broadcast_to(np.arange(12), (2, 3, 12)))
    np.testing.assert_array_equal(r["keys"], k)


def test_streaming_keeps_sinks_and_recent(cli, rng, tmp_path):
    k, v = cache(rng, T=50)
    out = str(tmp_path / "out")
    run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
           "--policy", "streaming(sinks=4)", "--budget-tokens", "12", "--out", out)
    r = load_out(out)
    np.testing.assert_array_equal(r["indices"], np.broadcast_to(np.r_[0:4, 42:50], (2, 3, 12)))
    check_gathered(r, k, v)
    assert r["summary"]["policy"] == "streaming(sinks=4)"


def test_float16_stays_float16(cli, rng, tmp_path):
    k, v = cache(rng, dtype=np.float16)
    out = str(tmp_path / "out")
    run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
           "--policy", "knorm", "--budget-tokens", "9", "--out", out)
    r = load_out(out)
    assert r["keys"].dtype == np.float16 and r["values"].dtype == np.float16
    np.testing.assert_array_equal(r["indices"], knorm_reference(k, 9))
    check_gathered(r, k, v)
    assert r["summary"]["inputs"]["keys"]["dtype"] == "float16"
    assert r["summary"]["outputs"]["values"]["dtype"] == "float16"


def test_fortran_order_reads_like_c_order(cli, rng, tmp_path):
    k, v = cache(rng)
    q = rng.standard_normal((2, 6, 8, 16)).astype(np.float32)
    args = ["--policy", "snapkv(window=8) | adakv", "--budget", "0.3"]
    run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
           "--queries", save(tmp_path, "q.npy", q), *args, "--out", tmp_path / "c")
    run_ok(cli, "--keys", save(tmp_path, "kf.npy", np.asfortranarray(k)),
           "--values", save(tmp_path, "vf.npy", np.asfortranarray(v)),
           "--queries", save(tmp_path, "qf.npy", np.asfortranarray(q)), *args,
           "--out", tmp_path / "f")
    c, f = load_out(tmp_path / "c"), load_out(tmp_path / "f")
    for name in ("indices", "counts", "keys", "values"):
        np.testing.assert_array_equal(c[name], f[name])


def test_snapkv_adakv_with_gqa_queries(cli, rng, tmp_path):
    """Without the binding: the layer budget is exact, the observation window is always kept,
    rows are ragged across heads and the padding is as documented."""
    L, H, T, d, w = 2, 2, 64, 16, 8
    k, v = cache(rng, L, H, T, d)
    q = rng.standard_normal((L, 3 * H, w, d)).astype(np.float32)
    out = str(tmp_path / "out")
    run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
           "--queries", save(tmp_path, "q.npy", q), "--policy", f"snapkv(window={w}) | adakv",
           "--budget", "0.25", "--out", out)
    r = load_out(out)
    check_gathered(r, k, v)
    np.testing.assert_array_equal(r["counts"].sum(axis=1), [2 * 16, 2 * 16])
    for row in np.ndindex(L, H):
        kept = r["indices"][row][: r["counts"][row]]
        assert set(range(T - w, T)) <= set(kept.tolist())
    s = r["summary"]
    assert s["allocators"] == ["adakv"] and s["q_heads"] == 6 and s["queries"] == w
    assert s["inputs"]["queries"]["shape"] == [L, 3 * H, w, d]


def test_queries_given_to_a_policy_that_ignores_them(cli, rng, tmp_path):
    k, v = cache(rng)
    q = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)
    out = str(tmp_path / "out")
    run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
           "--queries", save(tmp_path, "q.npy", q), "--policy", "knorm", "--budget", "0.25",
           "--out", out)
    np.testing.assert_array_equal(load_out(out)["indices"], knorm_reference(k, 10))


def test_existing_directory_files_are_replaced(cli, rng, tmp_path):
    k, v = cache(rng)
    out = tmp_path / "out"
    out.mkdir()
    (out / "indices.npy").write_text("old")
    (out / "notes.txt").write_text("mine")
    run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
           "--policy", "knorm", "--budget", "0.5", "--out", out)
    assert set(os.listdir(out)) == OUTPUTS | {"notes.txt"}
    np.testing.assert_array_equal(np.load(out / "indices.npy"), knorm_reference(k, 20))


def test_report(cli, rng, tmp_path):
    k, v = cache(rng, L=2, H=2, T=20)
    out = str(tmp_path / "out")
    p = run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
               "--policy", "knorm", "--budget-tokens", "5", "--out", out, "--report")
    text = p.stdout
    assert "\npolicy   knorm\n" in text
    assert "\nbudget   --budget-tokens 5: 5 of 20 tokens per (layer, KV head)\n" in text
    assert (f"\ninputs   keys {tmp_path / 'k.npy'} (2, 2, 20, 16) float32\n"
            f"         values {tmp_path / 'v.npy'} (2, 2, 20, 16) float32\n") in text
    assert "kept tokens per layer and KV head (of 20 each)" in text
    # Per layer: kept/tokens, fraction, then the count of every KV head.
    assert re.search(r"^0 +10/40 +25\.0% +5 5$", text, re.M), text
    assert re.search(r"^1 +10/40 +25\.0% +5 5$", text, re.M), text
    # Scores: knorm's are -||k||; min / mean / max of the kept and of the evicted tokens.
    assert "scores of kept and evicted tokens" in text
    scores = -np.linalg.norm(k.astype(np.float64), axis=-1)
    ref = knorm_reference(k, 5)
    num = r"(-?[0-9.e+-]+)"
    for l in range(2):
        for h in range(2):
            m = re.search(rf"^{l} +{h} +5 +0 +{num} / {num} / {num} +{num} / {num} / {num}$",
                          text, re.M)
            assert m, (l, h, text)
            kept = np.zeros(20, bool)
            kept[ref[l, h]] = True
            a, b = scores[l, h][kept], scores[l, h][~kept]
            want = [a.min(), a.mean(), a.max(), b.min(), b.mean(), b.max()]
            np.testing.assert_allclose([float(x) for x in m.groups()], want, rtol=2e-3)
        assert re.search(rf"^{l} +all +10 +0 +", text, re.M)


def test_report_of_ams_counts_non_finite_scores(cli, rng, tmp_path):
    """ams lowers the tokens it does not pick to -inf: the statistics say so instead of
    printing -inf as a mean."""
    k, v = cache(rng, L=1, H=2, T=160)
    q = rng.standard_normal((1, 2, 32, 16)).astype(np.float32)
    out = str(tmp_path / "out")
    p = run_ok(cli, "--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v),
               "--queries", save(tmp_path, "q.npy", q), "--policy", "snapkv(window=32) | ams",
               "--budget", "0.5", "--out", out, "--report")
    # Protected: 4 sinks + 32 recent (ams's own); every evicted token is at -inf.
    assert re.search(r"^0 +0 +80 +36 +[0-9.e+-]+ / [0-9.e+-]+ / [0-9.e+-]+ +- \(\+80 non-finite\)$",
                     p.stdout, re.M), p.stdout
    assert "inf /" not in p.stdout and "nan" not in p.stdout.lower()
    check_gathered(load_out(out), k, v)


def test_help_documents_every_option(cli):
    p = cli("compress", "--help")
    assert p.returncode == 0 and p.stderr == ""
    for opt in ("--keys", "--values", "--queries", "--policy", "--budget", "--budget-tokens",
                "--out", "--report", "--threads"):
        assert re.search(rf"^\s+{opt}\b", p.stdout, re.M), opt
    for s in ("default: none", "default: off", "=0", "float16", "indices.npy", "counts.npy",
              "summary.json", "-1 past", "Exit status"):
        assert s in p.stdout, s
    top = cli("--help")
    assert top.returncode == 0 and "compress" in top.stdout


# ---- the Python binding gives the same kept sets -----------------------------------------------

BINDING_CASES = [
    # spec, budget args, with queries (window), dtype, 3-d
    ("snapkv(window=16) | adakv", ("--budget", "0.25"), 16, np.float32, False),
    ("snapkv(window=8,kernel=3,pool=max) | pyramid", ("--budget-tokens", "20"), 8, np.float32,
     False),
    ("tova", ("--budget", "0.3"), 4, np.float32, False),
    ("h2o(recent_tokens=8)", ("--budget", "0.4"), 64, np.float32, False),
    ("keydiff | adakv(alpha=0.5)", ("--budget", "0.2"), 0, np.float32, False),
    ("snapkv(window=32) | ams", ("--budget", "0.5"), 32, np.float32, False),
    ("snapkv(window=16) | adakv", ("--budget", "0.25"), 16, np.float16, False),
    ("snapkv(window=16)", ("--budget", "0.5"), 16, np.float32, True),
]


@pytest.mark.binding
@pytest.mark.parametrize("spec,budget,window,dtype,three_d", BINDING_CASES)
def test_same_as_python_binding(cli, rng, tmp_path, spec, budget, window, dtype, three_d):
    kvpolicy = pytest.importorskip("kvpolicy")
    L, H, T, d = 2, 2, 96, 16
    k, v = cache(rng, L, H, T, d, dtype)
    q = rng.standard_normal((L, 4 * H, window, d)).astype(dtype) if window else None
    if three_d:
        k, v, q = k[0], v[0], None if q is None else q[0]
    args = ["--keys", save(tmp_path, "k.npy", k), "--values", save(tmp_path, "v.npy", v)]
    if q is not None:
        args += ["--queries", save(tmp_path, "q.npy", q)]
    out = str(tmp_path / "out")
    run_ok(cli, *args, "--policy", spec, *budget, "--out", out)
    r = load_out(out)
    kw = {"budget": float(budget[1])} if budget[0] == "--budget" else \
        {"budget_tokens": int(budget[1])}
    ref = kvpolicy.Policy(spec).select(k, v, q, **kw)
    np.testing.assert_array_equal(r["counts"], ref.counts)
    np.testing.assert_array_equal(r["indices"], ref.indices)
    check_gathered(r, k, v)
    assert r["summary"]["policy"] == kvpolicy.Policy(spec).spec


# ---- errors: the file or option and the problem, nothing written -------------------------------

@pytest.fixture
def kv(rng, tmp_path):
    """Valid keys/values files [2][3][40][16] float32 and an output path that does not exist."""
    k, v = cache(rng)
    return save(tmp_path, "k.npy", k), save(tmp_path, "v.npy", v), str(tmp_path / "out")


def test_missing_and_corrupt_files(cli, kv, tmp_path):
    kf, vf, out = kv
    base = ["--policy", "knorm", "--budget", "0.5", "--out", out]
    missing = str(tmp_path / "nope.npy")
    run_fail(cli, out, "--keys", missing, "--values", vf, *base, subject=missing,
             problem="no such file")
    run_fail(cli, out, "--keys", kf, "--values", str(tmp_path), *base, subject=str(tmp_path),
             problem="is a directory")
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"this is not a numpy file at all, just text\n" * 4)
    run_fail(cli, out, "--keys", str(garbage), "--values", vf, *base, subject=str(garbage),
             problem="not a valid .npy file")
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    run_fail(cli, out, "--keys", str(empty), "--values", vf, *base, subject=str(empty),
             problem="not a valid .npy file")
    header_only = tmp_path / "header.npy"
    header_only.write_bytes(open(vf, "rb").read()[:20])
    run_fail(cli, out, "--keys", kf, "--values", str(header_only), *base,
             subject=str(header_only), problem="not a valid .npy file")
    # Headers numpy would not write: no header at all, another format version, a shape that
    # asks for more data than the file holds (refused before any allocation).
    crafted = tmp_path / "crafted.npy"
    crafted.write_bytes(b"\x93NUMPY\x01\x00\x00\x00")
    run_fail(cli, out, "--keys", str(crafted), "--values", vf, *base, subject=str(crafted),
             problem="not a valid .npy file (empty header)")
    crafted.write_bytes(b"\x93NUMPY\x07\x00\x10\x00" + b" " * 16)
    run_fail(cli, out, "--keys", str(crafted), "--values", vf, *base, subject=str(crafted),
             problem="format version 7.0 is not supported")
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (100000000, 100000000, 64), }"
    header += b" " * (117 - len(header)) + b"\n"
    crafted.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header +
                        b"\x00" * 64)
    run_fail(cli, out, "--keys", str(crafted), "--values", vf, *base, subject=str(crafted),
             problem=["truncated: shape (100000000, 100000000, 64) of float32 needs "
                      f"{4 * 64 * 10**16} bytes of data, the file holds 64"])
    data = open(vf, "rb").read()
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes(data[:-100])
    run_fail(cli, out, "--keys", kf, "--values", str(truncated), *base, subject=str(truncated),
             problem=["truncated", "(2, 3, 40, 16)", f"needs {2 * 3 * 40 * 16 * 4} bytes",
                      f"holds {2 * 3 * 40 * 16 * 4 - 100}"])
    if os.geteuid() != 0:  # root reads any file
        unreadable = tmp_path / "unreadable.npy"
        unreadable.write_bytes(data)
        unreadable.chmod(0)
        run_fail(cli, out, "--keys", kf, "--values", str(unreadable), *base,
                 subject=str(unreadable), problem="cannot open")


@pytest.mark.parametrize("dtype,name", [(np.int32, "int32 ('<i4')"),
                                        (np.float64, "float64 ('<f8')"),
                                        (np.uint8, "uint8 ('|u1')"),
                                        (np.bool_, "bool ('|b1')"),
                                        (">f4", "float32 (big-endian) ('>f4')")])
def test_wrong_dtype(cli, kv, tmp_path, dtype, name):
    kf, vf, out = kv
    bad = save(tmp_path, "bad.npy", np.ones((2, 3, 40, 16), dtype=dtype))
    run_fail(cli, out, "--keys", bad, "--values", vf, "--policy", "knorm", "--budget", "0.5",
             "--out", out, subject=bad,
             problem=[f"dtype {name} is not supported", "accepted: float32, float16"])


def test_wrong_rank_and_shapes(cli, rng, kv, tmp_path):
    kf, vf, out = kv
    base = ["--policy", "knorm", "--budget", "0.5", "--out", out]
    flat = save(tmp_path, "flat.npy", np.ones((40, 16), np.float32))
    run_fail(cli, out, "--keys", flat, "--values", vf, *base, subject=flat,
             problem=["expected a 4-d array [layers][kv_heads][tokens][head_dim]",
                      "3-d [kv_heads][tokens][head_dim]", "got 2-d shape (40, 16)"])
    five = save(tmp_path, "five.npy", np.ones((1, 2, 3, 40, 16), np.float32))
    run_fail(cli, out, "--keys", kf, "--values", five, *base, subject=five,
             problem="got 5-d shape (1, 2, 3, 40, 16)")
    empty_axis = save(tmp_path, "empty_axis.npy", np.ones((2, 0, 40, 16), np.float32))
    run_fail(cli, out, "--keys", empty_axis, "--values", vf, *base, subject=empty_axis,
             problem="shape (2, 0, 40, 16) has an empty axis")
    longer = save(tmp_path, "longer.npy", np.ones((2, 3, 41, 16), np.float32))
    run_fail(cli, out, "--keys", kf, "--values", longer, *base, subject=longer,
             problem=["shape (2, 3, 41, 16) does not match keys", f"{kf} (2, 3, 40, 16)"])
    three = save(tmp_path, "three.npy", np.ones((3, 40, 16), np.float32))
    run_fail(cli, out, "--keys", kf, "--values", three, *base, subject=three,
             problem=["3-d shape (3, 40, 16) while keys", "(2, 3, 40, 16) are 4-d"])
    half = save(tmp_path, "half.npy", np.ones((2, 3, 40, 16), np.float16))
    run_fail(cli, out, "--keys", kf, "--values", half, *base, subject=half,
             problem=["dtype float16 differs from keys", "float32"])


def test_query_shapes(cli, kv, tmp_path):
    kf, vf, out = kv
    base = ["--keys", kf, "--values", vf, "--policy", "snapkv(window=4)", "--budget", "0.5",
            "--out", out]

    def q(name, shape, dtype=np.float32):
        return save(tmp_path, name, np.ones(shape, dtype))

    bad = q("q_heads.npy", (2, 4, 4, 16))
    run_fail(cli, out, *base, "--queries", bad, subject=bad,
             problem=["shape (2, 4, 4, 16) does not fit keys", "(2, 3, 40, 16)",
                      "4 query heads are not a multiple of 3 KV heads"])
    bad = q("q_dim.npy", (2, 6, 4, 8))
    run_fail(cli, out, *base, "--queries", bad, subject=bad, problem="head_dim differs")
    bad = q("q_layers.npy", (3, 6, 4, 16))
    run_fail(cli, out, *base, "--queries", bad, subject=bad, problem="number of layers differs")
    bad = q("q_many.npy", (2, 6, 41, 16))
    run_fail(cli, out, *base, "--queries", bad, subject=bad,
             problem="41 queries (the last positions of the sequence) for only 40 tokens")
    bad = q("q_rank.npy", (6, 4, 16))
    run_fail(cli, out, *base, "--queries", bad, subject=bad, problem="while keys")
    bad = q("q_dtype.npy", (2, 6, 4, 16), np.float16)
    run_fail(cli, out, *base, "--queries", bad, subject=bad, problem="dtype float16 differs")
    few = q("q_few.npy", (2, 6, 2, 16))
    run_fail(cli, out, *base, "--queries", few, subject=few,
             problem="snapkv: needs the last 4 queries, got 2")


def test_non_finite_inputs(cli, rng, kv, tmp_path):
    kf, vf, out = kv
    k, v = cache(rng)
    base = ["--policy", "knorm", "--budget", "0.5", "--out", out]
    k[1, 2, 5, 3] = np.nan
    k[1, 2, 7, 0] = np.inf  # later in C order: the first one is reported
    nan = save(tmp_path, "nan.npy", k)
    run_fail(cli, out, "--keys", nan, "--values", vf, *base, subject=nan,
             problem="contains NaN at index [1, 2, 5, 3]")
    v[0, 1, 39, 15] = -np.inf
    inf = save(tmp_path, "inf.npy", v)
    run_fail(cli, out, "--keys", kf, "--values", inf, *base, subject=inf,
             problem="contains -inf at index [0, 1, 39, 15]")
    q = np.ones((2, 3, 4, 16), np.float16)
    q[1, 0, 3, 2] = np.inf
    k16, v16 = (save(tmp_path, n, a.astype(np.float16)) for n, a in
                (("k16.npy", np.ones((2, 3, 40, 16))), ("v16.npy", np.ones((2, 3, 40, 16)))))
    qinf = save(tmp_path, "qinf.npy", q)
    run_fail(cli, out, "--keys", k16, "--values", v16, "--queries", qinf, *base, subject=qinf,
             problem="contains inf at index [1, 0, 3, 2]")


def test_policy_errors(cli, kv, tmp_path):
    kf, vf, out = kv
    base = ["--keys", kf, "--values", vf, "--budget", "0.5", "--out", out]
    run_fail(cli, out, *base, "--policy", "snapkvv", subject="--policy",
             problem=["unknown scorer 'snapkvv'", "valid scorers: h2o, snapkv, streaming, tova, "
                      "knorm, keydiff"])
    run_fail(cli, out, *base, "--policy", "knorm | bogus", subject="--policy",
             problem=["unknown stage 'bogus'", "allocators: uniform"])
    run_fail(cli, out, *base, "--policy", "snapkv(windw=4)", subject="--policy",
             problem="windw")
    run_fail(cli, out, *base, "--policy", "knorm | int2", subject="--policy",
             problem=["has a quantizer stage", "Session"])
    run_fail(cli, out, *base, "--policy", "knorm | nearest", subject="--policy",
             problem="has a merger stage")
    run_fail(cli, out, *base, "--policy", "kvzip", subject="--policy",
             problem=["reads context-reconstruction scores", "kvp_session_reconstruct"])
    run_fail(cli, out, *base, "--policy", "snapkv", subject="--queries",
             problem=["policy 'snapkv' reads the last 64 queries",
                      "no --queries file was given"])
    run_fail(cli, out, *base, "--policy", "h2o", subject="--queries", problem="reads queries")
    # A budget below what the scorer protects keeps the newest tokens, with a warning on stderr
    # and in summary.json (the run succeeds).
    q = save(tmp_path, "q.npy", np.ones((2, 3, 16, 16), np.float32))
    p = cli("compress", "--keys", kf, "--values", vf, "--queries", q, "--budget-tokens", "4",
            "--policy", "snapkv(window=16)", "--out", out)
    assert p.returncode == 0, p.stderr
    warning = ("budget of 4 tokens per head is below the 16 tokens snapkv protects (0 sinks + 16 "
               "recent): kept the newest 4 instead")
    assert p.stderr == f"kvpolicy compress: warning: {warning}\n"
    T = np.load(kf).shape[2]
    assert (np.load(os.path.join(out, "indices.npy")) == np.arange(T - 4, T)).all()
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        assert json.load(f)["warning"] == warning


@pytest.mark.parametrize("args,subject,problem", [
    (["--budget", "0"], "--budget", "0 is outside (0, 1]"),
    (["--budget", "1.5"], "--budget", "1.5 is outside (0, 1]"),
    (["--budget", "-0.2"], "--budget", "-0.2 is outside (0, 1]"),
    (["--budget", "nan"], "--budget", "is outside (0, 1]"),
    (["--budget-tokens", "0"], "--budget-tokens", "must be at least 1, got 0"),
    (["--budget", "0.5", "--budget-tokens", "3"], "--budget", "not both"),
    ([], "--budget", "give --budget"),
])
def test_budget_errors(cli, kv, args, subject, problem):
    kf, vf, out = kv
    run_fail(cli, out, "--keys", kf, "--values", vf, "--policy", "knorm", *args, "--out", out,
             subject=subject, problem=problem)


def test_budget_one_keeps_all(cli, rng, kv):
    kf, vf, out = kv
    run_ok(cli, "--keys", kf, "--values", vf, "--policy", "knorm", "--budget", "1", "--out", out)
    assert load_out(out)["counts"].min() == 40


def test_output_dir_errors(cli, kv, tmp_path):
    kf, vf, _ = kv
    base = ["--keys", kf, "--values", vf, "--policy", "knorm", "--budget", "0.5"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    run_fail(cli, str(a_file / "sub"), *base, "--out", a_file / "sub",
             subject=str(a_file / "sub"), problem=f"cannot create it: {a_file} is not a directory")
    p = cli("compress", *base, "--out", a_file)
    assert p.returncode == 1
    assert p.stderr == f"kvpolicy compress: {a_file}: exists and is not a directory\n"
    assert a_file.read_text() == "x"
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        run_fail(cli, str(ro), *base, "--out", ro, subject=str(ro), problem="not writable")


def test_failed_rename_leaves_nothing(cli, kv, tmp_path):
    """A directory named summary.json in DIR makes the last rename fail after the .npy files
    were renamed into place: those are removed again, and no temporary is left."""
    kf, vf, _ = kv
    out = tmp_path / "out"
    (out / "summary.json").mkdir(parents=True)
    (out / "summary.json" / "x").write_text("x")
    run_fail(cli, str(out), "--keys", kf, "--values", vf, "--policy", "knorm", "--budget", "0.5",
             "--out", out, subject=str(out), problem="cannot rename into summary.json")
    assert os.listdir(out) == ["summary.json"]


def test_nested_output_dir_created_only_on_success(cli, kv, tmp_path):
    kf, vf, _ = kv
    out = tmp_path / "a" / "b" / "c"
    run_fail(cli, str(tmp_path / "a"), "--keys", kf, "--values", vf, "--policy", "knorm",
             "--budget", "2", "--out", out, subject="--budget", problem="outside")
    run_ok(cli, "--keys", kf, "--values", vf, "--policy", "knorm", "--budget", "0.5",
           "--out", out)
    load_out(out)


def test_usage_errors(cli, kv):
    kf, vf, out = kv
    p = cli("compress", "--values", vf, "--policy", "knorm", "--budget", "0.5", "--out", out)
    assert p.returncode == 2
    assert p.stderr.startswith("kvpolicy compress: --keys is required")
    assert len(p.stderr.splitlines()) == 1
    p = cli("compress", "--keys", kf, "--values", vf, "--policy", "knorm", "--budget", "half",
            "--out", out)
    assert p.returncode == 2 and p.stderr.startswith("kvpolicy compress: ")
    p = cli()
    assert p.returncode == 2 and p.stderr.startswith("kvpolicy: ")
    p = cli("squeeze")
    assert p.returncode == 2
    assert not os.path.exists(out)
