"""The reference engine on the bundled model (skipped when the GGUF file is absent: run
scripts/fetch_model.sh). Kept to a few tokens."""

import os

import numpy as np
import pytest

import kvpolicy

MODEL = kvpolicy.default_model_path()
pytestmark = pytest.mark.skipif(not os.path.exists(MODEL), reason=f"model file {MODEL} is absent")


@pytest.fixture(scope="module")
def model():
    return kvpolicy.Model()


def test_tokenizer_round_trip(model):
    ids = model.encode("Hello, world! 12345")
    assert model.decode(ids) == "Hello, world! 12345"
    assert model.config["n_layers"] == 30 and model.config["n_head_kv"] == 3


def test_generate_with_policy(model):
    prompt = model.chat_prompt("What is the capital of France? Answer in one word.")
    full = model.engine("streaming", budget=1.0, record_queries=64, record_attention=True)
    logits = full.prefill(prompt)
    assert logits.shape == (model.config["n_vocab"],) and np.isfinite(logits).all()
    out = full.fork("snapkv(window=8)", budget=0.5)
    out.compress_now()
    assert max(out.lengths(0)) == round(0.5 * len(prompt))
    assert out.kv_bytes < full.kv_bytes
    text = model.decode(out.generate(4))
    assert len(text) > 0
    answer = model.generate("What is the capital of France?", "streaming", budget=1.0, max_new=8)
    assert "Paris" in answer


def test_missing_model_file():
    with pytest.raises(ValueError, match="not found"):
        kvpolicy.Model("/nonexistent/model.gguf")


def test_accuracy_tasks(model):
    rows = kvpolicy.tasks.passkey(model, ["snapkv(window=8)", "kvzip"], budgets=[0.5],
                                  length=256, depths=[0.5], max_new=10)
    assert [r["policy"] for r in rows] == ["full", "snapkv(window=8)", "kvzip"]
    assert rows[0]["correct"] and len(rows[0]["key"]) == 5
    fid = kvpolicy.tasks.fidelity(model, ["knorm"], budgets=[1.0, 0.5], prompt_tokens=96,
                                  cont_tokens=8)
    assert fid[0]["kl"] < 1e-6 and fid[0]["top1"] == 1.0  # budget 1.0: the full cache
    assert fid[1]["kl"] > 0


def test_retrieval_both_regimes(model):
    rows = kvpolicy.tasks.retrieval(model, ["snapkv(window=8)", "streaming"], budgets=[1.0, 0.3],
                                    task="passkey", length=320, prompts=1,
                                    regimes=("known", "agnostic"))
    assert len(rows) == 2 * 2 * 2
    assert {r["regime"] for r in rows} == {"known", "agnostic"}
    assert rows[0]["full_em"] and rows[0]["answer"].isdigit()
    for r in rows:
        if r["budget"] == 1.0:
            # Nothing evicted: the same answer log-probability as the full cache (up to the
            # summation order of a batched forward pass).
            assert abs(r["dlogp"]) < 1e-3 and r["em"] and r["kept"] == 1.0
        else:
            assert 0.25 < r["kept"] < 0.35
    # StreamingLLM at 30% keeps the first 4 tokens and the newest ones: this prompt's key sits
    # just after the instruction (depth 1%), so it is evicted in both regimes.
    lost = [r for r in rows if r["policy"] == "streaming" and r["budget"] == 0.3]
    assert all(r["dlogp"] < -1.0 for r in lost)
    with pytest.raises(ValueError, match="unknown task"):
        kvpolicy.tasks.retrieval(model, ["snapkv"], task="nope", length=320, prompts=1)
    with pytest.raises(ValueError, match="unknown regime"):
        kvpolicy.tasks.retrieval(model, ["snapkv"], task="niah", length=320, prompts=1,
                                 regimes=("maybe",))
