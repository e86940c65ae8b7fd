"""Side by side in transformers: kvpolicy's KVPolicyCache against kvpress's DecodingPress at the
same budget, on one long generation of the bundled model (SmolLM2-135M-Instruct, fp32, CPU).

    .venv/bin/python benchmarks/transformers_compare.py [--new 512] [--target 138]
                                                        [--interval 16] [--json out.json]

The full cache (a DynamicCache with transformers' sdpa attention) generates --new tokens greedily
(EOS suppressed) from a short chat prompt. Every other row teacher-forces the same tokens one per
forward, as decoding does, with its cache compressed while decoding: back to --target tokens per
KV head every --interval tokens (h2o: every token). The prompt is shorter than the target, so
nothing is compressed before decoding. The two libraries count the interval differently:
kvpress compresses at every interval-th decode step (when over the target), kvpolicy's Session
once the cache is over its target and interval tokens came in since its last compression (the
prefill's counts). Both then compress every interval steps and hold between target and
target + interval tokens, but they are in phase only when the cache first exceeds the target at a
multiple of the interval: the default target, 138 = 59 prompt tokens + 80 - 1, is such a budget
(both compress at steps 80, 96, ...); the script says when a choice is out of phase. Columns:
mean KL(full || row) of the next-token distributions over the generated tokens (and over the last
half), top-1 agreement with the full cache, mean and median milliseconds per decode forward
(compression included), bytes of K/V held at the end and at the peak (kvpress: the DynamicCache's
tensors, which hold exactly the kept rows and are reallocated by every append; kvpolicy:
KVPolicyCache.memory(), the rows held, and storage_bytes(), the buffers allocated: target +
interval rows per head, reserved once), and compression events per layer.

kvpress rows: DecodingPress(KnormPress) is the like-for-like baseline (kvpolicy's knorm scores the
same -||k||). DecodingPress(SnapKVPress) is attempted too: its window queries come from the
hidden states buffered since the last compression, and the buffer is emptied at every compression,
so with --interval below the window (64) it stops with an assertion, which the row reports.
kvpolicy's snapkv reads the Session's recorded post-RoPE queries of the newest 64 tokens instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import kvpolicy  # noqa: E402
import kvpolicy.integrations.transformers as kvt  # noqa: E402

PROMPT = ("Write a long numbered list of different animals, one per line, each with a "
          "one-sentence description of where it lives and what it eats.")


def dynamic_bytes(cache) -> int:
    return sum(4 * (l.keys.numel() + l.values.numel()) for l in cache.layers
               if getattr(l, "keys", None) is not None)


def run(model, prompt, tokens, cache, *, bytes_of, press=None, choose=False, eos=None):
    """Feeds the prompt, then `tokens` one per forward (or, with choose=True, the greedy choice
    at each step, EOS suppressed). Returns (log-probs [n][vocab] predicting each token, tokens,
    seconds per decode forward, bytes at the end, peak bytes)."""
    rows, times, peak, fed = [], [], 0, []
    ctx = press(model) if press is not None else _null()
    with torch.no_grad(), ctx:
        pos = len(prompt)
        out = model(torch.tensor([prompt]), past_key_values=cache,
                    cache_position=torch.arange(pos)).logits[0, -1]
        n = len(tokens)
        for i in range(n):
            rows.append(out)
            if choose:
                pick = out.clone()
                pick[eos] = -float("inf")
                t = int(pick.argmax())
            else:
                t = tokens[i]
            fed.append(t)
            t0 = time.perf_counter()
            out = model(torch.tensor([[t]]), past_key_values=cache,
                        position_ids=torch.tensor([[pos]]),
                        cache_position=torch.tensor([pos])).logits[0, -1]
            times.append(time.perf_counter() - t0)
            pos += 1
            peak = max(peak, bytes_of(cache))
    return (torch.log_softmax(torch.stack(rows).double(), -1), fed, times, bytes_of(cache), peak)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=512, help="generated tokens (default 512)")
    ap.add_argument("--target", type=int, default=138,
                    help="tokens per KV head (default 138: in phase, see above)")
    ap.add_argument("--interval", type=int, default=16,
                    help="decode steps between compressions (default 16)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    path = kvpolicy.default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    km = kvpolicy.Model(path)
    prompt = km.chat_prompt(PROMPT)
    if len(prompt) >= args.target:
        raise SystemExit(f"the prompt ({len(prompt)} tokens) must be shorter than --target")
    eos = km.tokenizer.eos
    first = args.target - len(prompt) + 1  # decode step at which the cache exceeds the target
    if first % args.interval:
        print(f"note: out of phase: kvpolicy first compresses at decode step {first}, kvpress at "
              f"{-(-first // args.interval) * args.interval} (a target of "
              f"{len(prompt) - 1 + args.interval * -(-first // args.interval)} would align them)")

    full_lp, tokens, full_t, full_b, full_peak = run(
        model, prompt, [0] * args.new, DynamicCache(config=model.config), bytes_of=dynamic_bytes,
        choose=True, eos=eos)
    print(f"prompt {len(prompt)} tokens, {len(tokens)} generated; start: "
          f"{km.decode(tokens[:40])!r}", flush=True)

    from kvpress import DecodingPress, KnormPress, SnapKVPress

    rows = [dict(name="full cache (DynamicCache, sdpa)", lp=full_lp, t=full_t, end=full_b,
                 peak=full_peak, events="-")]

    def kvpress_row(name, base):
        press = DecodingPress(base_press=base, compression_interval=args.interval,
                              target_size=args.target)
        model.set_attn_implementation("sdpa")
        try:
            lp, _, t, end, peak = run(model, prompt, tokens, DynamicCache(config=model.config),
                                      bytes_of=dynamic_bytes, press=press)
        except Exception as e:  # reported, not hidden
            rows.append(dict(name=name, error=f"{type(e).__name__}: {e}"))
            return
        # kvpress does not count events; every interval-th decode step compresses when over.
        rows.append(dict(name=name, lp=lp, t=t, end=end, peak=peak, events="-"))

    def kvpolicy_row(name, spec, interval):
        model.set_attn_implementation("kvpolicy")
        cache = kvt.KVPolicyCache(model, spec, budget_tokens=args.target, interval=interval)
        storage = [0]

        def held(c):
            storage[0] = max(storage[0], c.storage_bytes())
            return c.memory()

        lp, _, t, end, peak = run(model, prompt, tokens, cache, bytes_of=held)
        rows.append(dict(name=name, lp=lp, t=t, end=end, peak=peak,
                         storage=cache.storage_bytes(), storage_peak=storage[0],
                         events=cache.compressions[0]))
        model.set_attn_implementation("sdpa")

    kvpress_row(f"kvpress DecodingPress(KnormPress)", KnormPress())
    kvpolicy_row(f"kvpolicy KVPolicyCache('knorm')", "knorm", args.interval)
    kvpress_row(f"kvpress DecodingPress(SnapKVPress)", SnapKVPress())
    kvpolicy_row(f"kvpolicy KVPolicyCache('snapkv')", "snapkv", args.interval)
    kvpolicy_row(f"kvpolicy KVPolicyCache('h2o'), every token", "h2o", 0)

    half = len(tokens) // 2
    print(f"\nbudget {args.target} tokens per KV head, compression every {args.interval} decode "
          f"steps (h2o: every step); {len(tokens)} tokens teacher-forced; torch threads "
          f"{args.threads}\n")
    print("| cache | KL mean | KL 2nd half | top-1 | ms/token mean | ms/token median | "
          "KV bytes end | KV bytes peak | storage end / peak | events/layer |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    out = []
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:120]} | | | | | | | | |")
            out.append(dict(name=r["name"], error=r["error"]))
            continue
        kl = (full_lp.exp() * (full_lp - r["lp"])).sum(-1)
        top1 = float((r["lp"].argmax(-1) == full_lp.argmax(-1)).double().mean())
        ms = [1000 * x for x in r["t"]]
        st = (f"{r['storage']:,} / {r['storage_peak']:,}" if "storage" in r else "= held")
        rec = dict(name=r["name"], kl=float(kl.mean()), kl_second_half=float(kl[half:].mean()),
                   top1=top1, ms_mean=statistics.fmean(ms), ms_median=statistics.median(ms),
                   bytes_end=r["end"], bytes_peak=r["peak"], events=r["events"])
        out.append(rec)
        print(f"| {r['name']} | {rec['kl']:.4f} | {rec['kl_second_half']:.4f} | {top1:.1%} | "
              f"{rec['ms_mean']:.1f} | {rec['ms_median']:.1f} | {r['end']:,} | {r['peak']:,} | "
              f"{st} | {r['events']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), prompt_tokens=len(prompt), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
