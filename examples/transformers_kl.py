# %% [markdown]
# # KL(full || compressed) against budget, in transformers
#
# Notebook-style example (cells marked `# %%`; runs as a plain script too) of
# `kvpolicy.integrations.transformers.KVPolicyCache`: the bundled SmolLM2-135M-Instruct, loaded by
# transformers from its GGUF file, reads a real text (GPL-3) as the prompt; the cache compresses
# it to a budget, and the next 48 tokens of the text are fed one by one as a decode loop does.
# At every one of them we compare the next-token distribution with the full cache's:
# KL(full || compressed), averaged over the 48 positions, for three policies over five budgets.
# h2o also evicts while decoding (every token), snapkv and snapkv | adakv compress the prompt
# only. About 3 minutes on 2 CPU cores (measured: 189 s wall, 1.8 GB peak memory).
#
#     .venv/bin/python examples/transformers_kl.py            # writes transformers_kl.{json,png}
#     /usr/bin/python3 examples/transformers_kl.py --plot transformers_kl.json
#         # plot only: any Python with matplotlib (Debian's python3-matplotlib), no torch
#
# Needs torch, transformers and gguf (`bash scripts/setup.sh --with-torch`); the plot needs
# matplotlib and is skipped (numbers still printed and saved) when it does not import.

# %%
import json
import os
import sys
import time

OUT = os.environ.get("KVPOLICY_OUT", ".")
POLICIES = ["snapkv", "snapkv | adakv", "h2o"]
BUDGETS = [0.1, 0.2, 0.3, 0.5, 0.7]  # snapkv protects its 64-token window: >= 70 of 695
PROMPT_CHARS = (3000, 6600)  # a window of the GPL-3 text: ~750 tokens
CONTINUATION = 48


def plot(results, path):
    """KL against budget, one line per policy (log scale); False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in results["policies"]:
        rows = [r for r in results["rows"] if r["policy"] == policy]
        ax.plot([r["budget"] for r in rows], [r["kl"] for r in rows], marker="o", label=policy)
    ax.set_xlabel("budget (kept fraction of the prompt per KV head)")
    ax.set_ylabel("mean KL(full || compressed), nats")
    ax.set_yscale("log")
    ax.set_title(f"{results['model']}: {results['prompt_tokens']}-token prompt, "
                 f"next {results['continuation']} tokens", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


if len(sys.argv) == 3 and sys.argv[1] == "--plot":  # plot a saved run (no torch needed)
    with open(sys.argv[2]) as f:
        saved = json.load(f)
    png = os.path.splitext(sys.argv[2])[0] + ".png"
    print(png if plot(saved, png) else "matplotlib is not importable")
    sys.exit(0)

# %%
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import kvpolicy  # noqa: E402
import kvpolicy.integrations.transformers as kvt  # noqa: E402  (registers "kvpolicy")

torch.set_num_threads(2)
hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
path = kvpolicy.default_model_path()
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                             gguf_file=os.path.basename(path),
                                             dtype=torch.float32, attn_implementation="kvpolicy")
model.eval()

with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
    text = " ".join(f.read().split())
ids = kvpolicy.Model(path).encode(text[PROMPT_CHARS[0]:PROMPT_CHARS[1]])
prompt, cont = ids[:-CONTINUATION], ids[-CONTINUATION:]
print(f"prompt {len(prompt)} tokens, continuation {len(cont)}")

# %% The full cache: one forward over prompt + continuation (a DynamicCache; "kvpolicy" attention
# without a KVPolicyCache is transformers' sdpa). Row i predicts cont[i].
with torch.no_grad():
    logits = model(torch.tensor([ids]), past_key_values=DynamicCache(config=model.config)).logits
full = torch.log_softmax(logits[0, len(prompt) - 1:-1].double(), dim=-1)


# %%
def decode_logprobs(policy, budget):
    """Log-probabilities of the next token at each continuation position, with the prompt
    compressed to `budget` and the continuation fed one token at a time."""
    cache = kvt.KVPolicyCache(model, policy, budget=budget)
    rows = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), past_key_values=cache).logits[0, -1]
        for t in cont:
            rows.append(out)
            out = model(torch.tensor([[t]]), past_key_values=cache).logits[0, -1]
    return torch.log_softmax(torch.stack(rows).double(), dim=-1), cache


results = {"model": "SmolLM2-135M-Instruct", "prompt_tokens": len(prompt),
           "continuation": len(cont), "policies": POLICIES, "rows": []}
t0 = time.perf_counter()
print(f"{'policy':16s} {'budget':>6s} {'KL':>8s} {'top-1':>6s} {'KV KiB':>8s}")
for policy in POLICIES:
    for budget in BUDGETS:
        lp, cache = decode_logprobs(policy, budget)
        kl = (full.exp() * (full - lp)).sum(-1)  # KL(full || compressed) per position
        top1 = (lp.argmax(-1) == full.argmax(-1)).double().mean().item()
        row = {"policy": policy, "budget": budget, "kl": kl.mean().item(), "top1": top1,
               "kv_bytes": cache.memory()}
        results["rows"].append(row)
        print(f"{policy:16s} {budget:6.2f} {row['kl']:8.4f} {top1:6.0%} "
              f"{row['kv_bytes'] / 1024:8.0f}")
print(f"{time.perf_counter() - t0:.0f} s")

# %%
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "transformers_kl.json"), "w") as f:
    json.dump(results, f, indent=1)
png = os.path.join(OUT, "transformers_kl.png")
print(png if plot(results, png) else
      "matplotlib is not importable here: numbers saved to transformers_kl.json "
      "(/usr/bin/python3 examples/transformers_kl.py --plot transformers_kl.json draws "
      "them with Debian's python3-matplotlib)")
