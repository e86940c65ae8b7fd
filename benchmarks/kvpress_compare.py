#!/usr/bin/env python3
"""Side by side: kvpolicy and kvpress on the bundled model, identical inputs.

Installs nothing. Needs, besides the kvpolicy package: torch, transformers, gguf (transformers'
GGUF loader) and kvpress, e.g. in a scratch venv:
    python3 -m venv /tmp/kvp-cmp && /tmp/kvp-cmp/bin/pip install kvpress gguf
    /tmp/kvp-cmp/bin/pip install --no-build-isolation .   # kvpolicy (needs scikit-build-core, pybind11)
    OMP_WAIT_POLICY=passive /tmp/kvp-cmp/bin/python benchmarks/kvpress_compare.py

The GGUF file (scripts/fetch_model.sh) is loaded through transformers (dequantized to fp32) and
run on the CPU. For every passkey prompt (the accuracy benchmark's, kvpolicy.tasks) one full
prefill records each attention layer's inputs (hidden states, keys, values, attention weights,
rotary embeddings); every press of both libraries then compresses those same tensors, layer by
layer, exactly as kvpress's forward hook would, and the compressed cache answers greedily. Only
ObservedAttention/H2O is given the attention weights (it needs them); the others compute the
window attention they read themselves, as in a model with sdpa attention.
Reported per (press, budget):
  - Jaccard of the kept token sets per (layer, KV head, prompt): mean and minimum;
  - passkey accuracy of each library (greedy answer's first 5 digits == the key);
  - compression time per layer (the press's compress() on one layer, mean), in ms.
kvpolicy runs through kvpolicy.integrations.kvpress.KVPolicyPress: same runtime, same cache,
only scoring and selection differ. Budget = kept fraction (compression_ratio = 1 - budget;
both keep max(1, int(T * (1 - ratio))) per head).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

try:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    import kvpress
    from kvpress import (AdaKVPress, KeyDiffPress, KnormPress, ObservedAttentionPress,
                         PyramidKVPress, SnapKVPress, StreamingLLMPress, TOVAPress)
except ImportError as e:
    sys.exit(f"kvpress_compare: {e}; this script needs torch, transformers, gguf and kvpress "
             "(it installs nothing; see its docstring)")

import kvpolicy
from kvpolicy import _core
from kvpolicy.integrations.kvpress import KVPolicyPress

# (name, kvpolicy spec, kvpress press for a compression ratio). Specs set the kvpolicy
# parameters that make each scorer the same method as kvpress's (README policy table).
PAIRS: List[Tuple[str, str, Callable[[float], Any]]] = [
    ("SnapKV", "snapkv", lambda r: SnapKVPress(compression_ratio=r)),
    ("ObservedAttention/H2O", "h2o(recent_tokens=0,normalize=true)",
     lambda r: ObservedAttentionPress(compression_ratio=r)),
    ("StreamingLLM", "streaming(sinks=4)", lambda r: StreamingLLMPress(compression_ratio=r)),
    ("TOVA", "tova", lambda r: TOVAPress(compression_ratio=r)),
    ("KNorm", "knorm", lambda r: KnormPress(compression_ratio=r)),
    ("KeyDiff", "keydiff", lambda r: KeyDiffPress(compression_ratio=r)),
    ("PyramidKV", "snapkv | pyramid", lambda r: PyramidKVPress(compression_ratio=r)),
    ("AdaKV", "snapkv | adakv(alpha=0.2)",
     lambda r: AdaKVPress(SnapKVPress(compression_ratio=r), alpha_safeguard=0.2)),
]


def set_attention(model: Any, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


class Capture:
    """Records each attention layer's inputs and attention weights during one prefill."""

    def __init__(self, model: Any) -> None:
        self.layers = model.model.layers
        self.rec: Dict[int, Dict[str, Any]] = {}

    def hook(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        self.rec[module.layer_idx] = dict(
            hidden_states=kwargs["hidden_states"].detach().clone(),
            attentions=None if output[1] is None else output[1].detach().clone(),
            position_embeddings=tuple(t.detach().clone() for t in kwargs["position_embeddings"]))

    def __enter__(self) -> "Capture":
        self.handles = [l.self_attn.register_forward_hook(self.hook, with_kwargs=True)
                        for l in self.layers]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def kept_sets(press: Any, lib: str, module: Any, rec: dict, k: Any, v: Any) -> List[List[set]]:
    """Kept token sets per (batch row 0) KV head of one layer, after press.compress()."""
    H, T = k.shape[1], k.shape[2]
    if lib == "kvpolicy":
        r = press.last_selection[0]
        return [set(r.kept(0, h).tolist()) for h in range(H)]
    masked = getattr(module, "masked_key_indices", None)
    if masked is not None:  # AdaKV: masking, not gathering
        _, heads, seqs = (t.tolist() for t in masked)
        out = [set(range(T)) for _ in range(H)]
        for h, t in zip(heads, seqs):
            out[h].discard(t)
        return out
    # Gathering presses: compress values that hold their own token index.
    idx = torch.arange(T, dtype=k.dtype).view(1, 1, T, 1).expand_as(v).contiguous()
    _, got = press.compress(module, rec["hidden_states"], k, idx, rec["attentions"],
                            {"position_embeddings": rec["position_embeddings"]})
    return [set(got[0, h, :, 0].round().long().tolist()) for h in range(H)]


def greedy(model: Any, cache: Any, first: int, pos: int, n: int, eos: int) -> List[int]:
    out = [first]
    tok = first
    for i in range(n - 1):
        if tok == eos:
            break
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                           position_ids=torch.tensor([[pos + i]])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
    return out


def run(args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(args.threads)
    path = kvpolicy.default_model_path()
    kvp_model = kvpolicy.Model(path)  # prompts (the accuracy benchmark's) and decoding of answers
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    eos = kvp_model.tokenizer.eos
    layers = model.model.layers
    cells: Dict[Tuple[str, float], Dict[str, Any]] = {}
    full_correct = 0
    for depth in args.depths:
        ids, key = _core.passkey_prompt(kvp_model._m, args.length, depth, args.seed)
        T = len(ids)
        set_attention(model, "eager")  # attention weights for ObservedAttention
        cache = DynamicCache()
        with Capture(model) as cap, torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0, -1]
        first = int(logits.argmax())
        kv = [(cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in range(len(layers))]
        set_attention(model, "sdpa")  # decoding (AdaKV's key masking patches sdpa, not eager)
        ans = kvp_model.decode(greedy(model, cache, first, T, args.max_new, eos))
        ok_full = _core.first_five_digits(ans) == key
        full_correct += ok_full
        print(f"depth {depth:.2f}: {T} tokens, key {key}, full cache: {ans!r} "
              f"({'ok' if ok_full else 'miss'})", file=sys.stderr)
        for name, spec, make in PAIRS:
            for budget in args.budgets:
                ratio = 1.0 - budget
                cell = cells.setdefault((name, budget), dict(
                    press=name, spec=spec, budget=budget, jaccard=[],
                    correct={"kvpress": 0, "kvpolicy": 0}, ms={"kvpress": [], "kvpolicy": []}))
                sets = {}
                for lib in ("kvpress", "kvpolicy"):
                    press = make(ratio) if lib == "kvpress" else KVPolicyPress(spec, ratio)
                    if hasattr(press, "__post_init_from_model__"):
                        press.__post_init_from_model__(model)
                    for l in layers:
                        l.self_attn.masked_key_indices = None
                    new = DynamicCache()
                    per_layer = []
                    for i, layer in enumerate(layers):
                        mod, rec = layer.self_attn, dict(cap.rec[i])
                        if name != "ObservedAttention/H2O":
                            # As in an sdpa model (kvpress's usual set-up): the presses compute
                            # the window attention they need themselves.
                            rec["attentions"] = None
                        k, v = kv[i]
                        t0 = time.perf_counter()
                        k2, v2 = press.compress(mod, rec["hidden_states"], k, v, rec["attentions"],
                                                {"position_embeddings": rec["position_embeddings"]})
                        cell["ms"][lib].append(1e3 * (time.perf_counter() - t0))
                        per_layer.append(kept_sets(press, lib, mod, rec, k, v))
                        new.update(k2, v2, i)
                    sets[lib] = per_layer
                    ans = kvp_model.decode(greedy(model, new, first, T, args.max_new, eos))
                    cell["correct"][lib] += _core.first_five_digits(ans) == key
                for a, b in zip(sets["kvpress"], sets["kvpolicy"]):
                    for sa, sb in zip(a, b):
                        cell["jaccard"].append(len(sa & sb) / max(1, len(sa | sb)))
        print(f"depth {depth:.2f} done", file=sys.stderr)
    n = len(args.depths)
    rows = []
    for c in cells.values():
        rows.append(dict(press=c["press"], spec=c["spec"], budget=c["budget"],
                         jaccard_mean=float(np.mean(c["jaccard"])),
                         jaccard_min=float(np.min(c["jaccard"])),
                         acc_kvpress=c["correct"]["kvpress"] / n,
                         acc_kvpolicy=c["correct"]["kvpolicy"] / n,
                         ms_kvpress=float(np.mean(c["ms"]["kvpress"])),
                         ms_kvpolicy=float(np.mean(c["ms"]["kvpolicy"]))))
    return dict(length=args.length, depths=args.depths, full_accuracy=full_correct / n,
                kvpress_version=getattr(kvpress, "__version__", "?"),
                torch_version=torch.__version__, rows=rows)


def markdown(res: Dict[str, Any]) -> str:
    out = [f"Passkey prompts of {res['length']} tokens, depths {res['depths']}; full cache "
           f"{res['full_accuracy']:.0%}. Jaccard of kept sets per (layer, KV head, prompt).", "",
           "| press | kvpolicy spec | budget | Jaccard mean / min | passkey kvpress | "
           "passkey kvpolicy | ms/layer kvpress | ms/layer kvpolicy |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        spec = r["spec"].replace("|", "\\|")
        out.append(f"| {r['press']} | `{spec}` | {r['budget']:.0%} | {r['jaccard_mean']:.3f} / "
                   f"{r['jaccard_min']:.3f} | {r['acc_kvpress']:.0%} | {r['acc_kvpolicy']:.0%} | "
                   f"{r['ms_kvpress']:.2f} | {r['ms_kvpolicy']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=1024, help="passkey prompt tokens (1024)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.3],
                    help="kept fractions (0.1 0.2 0.3)")
    ap.add_argument("--max-new", type=int, default=12, help="answer tokens (12)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    res = run(args)
    print(markdown(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
