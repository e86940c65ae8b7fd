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
    rows = kvpolicy.tasks.passkey(model, ["snapkv(window=8)"], budgets=[0.5], length=256,
                                  depths=[0.5], max_new=10)
    assert [r["policy"] for r in rows] == ["full", "snapkv(window=8)"]
    assert rows[0]["correct"] and len(rows[0]["key"]) == 5
    fid = kvpolicy.tasks.fidelity(model, ["knorm"], budgets=[1.0, 0.5], prompt_tokens=96,
                                  cont_tokens=8)
    assert fid[0]["kl"] < 1e-6 and fid[0]["top1"] == 1.0  # budget 1.0: the full cache
    assert fid[1]["kl"] > 0
