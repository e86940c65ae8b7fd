#!/usr/bin/env python3
"""Seed corpora for the fuzz targets, one folder per target under fuzz/seeds/:

  fuzz_gguf       a tiny but complete Llama GGUF (1 layer, embedding 32, a 260-token byte-level
                  vocabulary with merges, control tokens, a ChatML template; tensors in F32, F16,
                  BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0) and a metadata-only file with every value
                  type and nested arrays (needs gguf-py: gguf 0.19.0 and numpy)
  fuzz_spec       every stage with its parameters, pipelines in every stage order, each spec
                  followed by NUL and bytes that choose the cache
  fuzz_profile    the bundled SmolLM2 profiles and small variants (NaN / Infinity tokens, escapes,
                  nested unknown keys, a layer count that disagrees, loss curves good and bad)
  fuzz_tokenizer  flags byte + text: words, digits, contractions, whitespace runs, ChatML markup,
                  Unicode letters and numbers, invalid UTF-8; and vocabularies from the input

fuzz_c_api's seeds are binary call sequences that only the harness's decoder gives a meaning to,
so they are not written here: calls_* are the 150 largest inputs of a corpus that earlier runs
grew and `fuzz_c_api -merge=1` minimized (they reach about 80% of its coverage edges). Files
named regress-* in any folder are inputs that found a bug; this script leaves them alone.

  python fuzz/make_seeds.py [target ...]     (default: all but fuzz_gguf, which needs gguf-py)
"""
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "seeds"


def write(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


# ---- fuzz_gguf -----------------------------------------------------------------------------

def byte_chars():
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    m = dict(zip(bs, cs))
    return [chr(m[b]) for b in range(256)]


def tiny_llama(path):
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    E, F, H, HKV, D = 32, 32, 2, 1, 16
    toks = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars() + ["he", "ll", "hell", "Ġw"]
    types = [3, 3, 3] + [1] * (len(toks) - 3)
    merges = ["h e", "l l", "he ll", "Ġ w"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'}}")

    def t(name, shape, qt):
        x = rng.standard_normal(shape).astype(np.float32) * 0.1
        if qt == T.F32:
            w.add_tensor(name, x)
        elif qt == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quantize(x, qt), raw_shape=quantize(x, qt).shape, raw_dtype=qt)

    V = len(toks)
    t("token_embd.weight", (V, E), T.Q8_0)
    t("output_norm.weight", (E,), T.F32)
    t("blk.0.attn_norm.weight", (E,), T.F32)
    t("blk.0.ffn_norm.weight", (E,), T.F32)
    t("blk.0.attn_q.weight", (H * D, E), T.Q4_1)
    t("blk.0.attn_k.weight", (HKV * D, E), T.Q4_0)
    t("blk.0.attn_v.weight", (HKV * D, E), T.Q5_0)
    t("blk.0.attn_output.weight", (E, H * D), T.Q5_1)
    t("blk.0.ffn_gate.weight", (F, E), T.F16)
    t("blk.0.ffn_up.weight", (F, E), T.BF16)
    t("blk.0.ffn_down.weight", (E, F), T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def metadata_only(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 700)
    w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.arr", [1, 2, 3])
    w.add_array("t.nested", [[1, 2], ["a", "b"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def seeds_gguf():
    d = OUT / "fuzz_gguf"
    d.mkdir(parents=True, exist_ok=True)
    tiny_llama(d / "tiny_llama.gguf")
    metadata_only(d / "metadata.gguf")


# ---- fuzz_spec -----------------------------------------------------------------------------

SPECS = [
    "streaming", "streaming(sinks=0)", "h2o", "h2o(recent=0.25,recent_tokens=3,sinks=1,"
    "normalize=true,reduce=sum)", "snapkv", "snapkv(window=4,kernel=3,pool=max,reduce=max,"
    "sinks=2)", "snapkv(preset=authors)", "tova", "knorm", "keydiff",
    "snapkv(window=2) | uniform", "snapkv(window=2) | pyramid(beta=4,window=2)",
    "snapkv(window=2) | adakv(alpha=0.5)", "snapkv(window=2) | depthkv(weights=1:2:3)",
    "knorm | depthkv(weights=0:1,power=0.5,min_tokens=2)",
    "snapkv(window=2) | ams(window=2,kernel=3,segment_mass=0.5,min_seg_len=2,max_seg_len=8,"
    "min_keep=1,sinks=1,keep_last=2,lambda=0.5,beta=0.5)",
    "snapkv(window=2) | pyramid | adakv | ams",
    "streaming | semantic", "knorm | semantic(tau=0.5,chunk=4,weight=mean,delimiters=.\\n\\s)",
    "h2o | nearest", "streaming | int2", "knorm | int4(group=8,residual=4,rotate=false)",
    "snapkv(window=1) | kivi(group=16,residual=0,token_norm=true)",
    "tova | adakv | semantic(chunk=0) | int2",
    "snapkv(window=2) | depthkv(profile=no_such_profile.json)",
    "  snapkv ( window = 2 ) |  uniform  ",
]


def seeds_spec():
    rng = random.Random(19)
    for i, spec in enumerate(SPECS):
        tail = bytes(rng.randrange(256) for _ in range(rng.randrange(16, 64)))
        write("fuzz_spec", f"spec_{i:02d}", spec.encode() + b"\0" + tail)


# ---- fuzz_profile --------------------------------------------------------------------------

def seeds_profile():
    for p in sorted((ROOT.parent / "benchmarks" / "profiles").glob("*.json")):
        shutil.copy(p, OUT / "fuzz_profile" / p.name)
    write("fuzz_profile", "minimal.json", '{"sensitivity": [1, 0.5, 0]}')
    write("fuzz_profile", "full.json",
          '{"model": "m", "scorer": "snapkv", "budget": 0.2, "metric": "kl", "layers": 3,\n'
          ' "texts": ["a", "b"], "extra": {"k": [1, {"x": null}], "t": true},\n'
          ' "sensitivity": [1e-3, 2.5E+1, 0.0]}\n')
    write("fuzz_profile", "nan.json", '{"sensitivity": [1, NaN, Infinity, -Infinity]}')
    write("fuzz_profile", "escapes.json",
          '{"model": "a\\"b\\\\c\\n\\t\\u00e9", "scorer": "\\/", "sensitivity": [2]}')
    write("fuzz_profile", "mismatch.json", '{"layers": 4, "sensitivity": [1, 2]}')
    write("fuzz_profile", "empty.json", '{"sensitivity": []}')
    write("fuzz_profile", "nested.json", '{"a": [[[[{"b": [[]]}]]]], "sensitivity": [-0.0, 1]}')
    write("fuzz_profile", "curves.json",
          '{"sensitivity": [1, 0.5], "curve_budgets": [0.05, 0.2, 0.5],\n'
          ' "curves": [[2, 1, 0.25], [0.5, 0.5, 0]]}')
    write("fuzz_profile", "curves_bad.json",
          '{"sensitivity": [1], "curve_budgets": [0.5, 0.2, 1], "curves": [[1, NaN]]}')


# ---- fuzz_tokenizer ------------------------------------------------------------------------

TEXTS = [
    b"Hello, world! hello    world",
    b"I'm sure it's what we'll see; they've re-read 'em",
    b"1234567890 3.14159 x2 \xd9\xa3\xd9\xa4 \xe2\x85\xa7",
    b"\t\n  \r\n\xc2\xa0\xe3\x80\x80end   ",
    b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    b"na\xc3\xafve caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 \xce\xa9",
    b"\xff\xfe bad utf8 \xc3 \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 \xc0\xaf ok",
    b"def f(x):\n    return x**2  # \xe2\x89\xa4 10\n",
    b"hellhell hello hel lo",
]


def seeds_tokenizer():
    # FuzzedDataProvider takes integers from the end of the input: the flags byte comes last, and
    # the text is what the vocabulary choices leave at the front.
    for i, text in enumerate(TEXTS):
        # flags: pre-tokenizer, special parsing, BOS; the vocabulary as built in
        write("fuzz_tokenizer", f"text_{i:02d}", text + bytes([i % 8]))
    # Bytes without a token (with and without an unknown token): from the end, the flags, how
    # many bytes to drop (the byte mod 8, plus 1), then the bytes.
    write("fuzz_tokenizer", "vocab_drop_unk", TEXTS[0] + b"lo\x01" + bytes([8 | 16 | 2]))
    write("fuzz_tokenizer", "vocab_drop", TEXTS[1] + b" \x00" + bytes([8]))
    # Tokens, merges and special tokens from the input (strings come from the front).
    write("fuzz_tokenizer", "vocab_extra", b"hel\\ lo\\ <s>\\ " + TEXTS[8] + b"\x03\x03" + bytes([32 | 2]))


TARGETS = {"fuzz_gguf": seeds_gguf, "fuzz_spec": seeds_spec, "fuzz_profile": seeds_profile,
           "fuzz_tokenizer": seeds_tokenizer}

if __name__ == "__main__":
    wanted = sys.argv[1:] or [t for t in TARGETS if t != "fuzz_gguf"]
    for t in wanted:
        (OUT / t).mkdir(parents=True, exist_ok=True)
        TARGETS[t]()
        files = sorted((OUT / t).iterdir())
        print(f"{t}: {len(files)} files, {sum(f.stat().st_size for f in files)} bytes")
