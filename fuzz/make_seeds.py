#!/usr/bin/env python3
"""Seed inputs for fuzz_gguf: a tiny but complete Llama GGUF (1 layer, embedding 32, a 260-token
byte-level vocabulary with merges, control tokens, a ChatML template; tensors in F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0) and a metadata-only file with every value type and nested
arrays. Run once with gguf-py (gguf 0.19.0, numpy):  python fuzz/make_seeds.py"""
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

OUT = Path(__file__).resolve().parent / "seeds"


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


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    tiny_llama(OUT / "tiny_llama.gguf")
    metadata_only(OUT / "metadata.gguf")
    for p in sorted(OUT.iterdir()):
        print(p.name, p.stat().st_size)
