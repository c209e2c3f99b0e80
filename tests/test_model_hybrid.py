"Per-layer attention (sliding windows, soft caps, scales) and Gemma 2/3 against Hugging Face transformers."
import json, math
import pytest, torch
from pagednb.model import (load_model, greedy_generate, NoCacheAttention, ModelConfig, LayerAttention, attend,
                           window_mask)
from helpers import HYBRID_FAMILIES, HYBRID_VOCAB, tiny_hybrid_model

FAMILIES = list(HYBRID_FAMILIES)

def _window(family): return HYBRID_FAMILIES[family][2]

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    "Each family's transformers model and ours, loaded from the folder transformers saved (built once)."
    out = {}
    for f in FAMILIES:
        path = tmp_path_factory.mktemp(f)
        hf = tiny_hybrid_model(f, path)
        out[f] = (hf, *load_model(path, dtype="float32", device="cpu"), path)
    return out

def _prompt(n, seed):
    return torch.randint(0, HYBRID_VOCAB, (n,), generator=torch.Generator().manual_seed(seed))

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(family, models):
    hf, model, tok, cfg, _ = models[family]
    assert tok is None and cfg.model_type == hf.config.model_type
    n = 4*_window(family) + 3                                   # four windows and then some
    x = _prompt(n, 1)
    with torch.inference_mode():
        ours = model.compute_logits(model(x, torch.arange(n), NoCacheAttention([n])))
        ref = hf(x[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(family, models):
    "One ragged batch through the per-layer cache (`LayerKVCache`), and without a cache, equals `generate`."
    hf, model, *_ = models[family]
    w = _window(family)
    prompts = [_prompt(n, 2 + i).tolist() for i, n in enumerate((5, 3*w + 1, 4*w))]
    ours = greedy_generate(model, prompts, 16)
    for p, o in zip(prompts, ours):
        x = torch.tensor([p])       # an explicit mask: a random prompt may hold the pad id, which generate would mask
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0)[0, len(p):]
        assert o == ref.tolist(), family
    assert greedy_generate(model, prompts, 16, use_cache=False) == ours

def test_windows_change_the_output(models):
    "The windows matter here: the same weights with every window dropped give other logits."
    from dataclasses import replace
    hf, model, _, cfg, _ = models["qwen2_swa"]
    x = _prompt(40, 3)
    with torch.inference_mode():
        windowed = model.compute_logits(model(x, torch.arange(40), NoCacheAttention([40])))
        full = [replace(a, window=None) for a in cfg.layer_attentions]
        unwindowed = model.compute_logits(model(x, torch.arange(40), NoCacheAttention([40], full)))
    assert not torch.allclose(windowed[-8:], unwindowed[-8:], atol=1e-3)
    torch.testing.assert_close(windowed[:8], unwindowed[:8])           # within the window: the same

EXPECTED = {   # family -> each layer's (window, softcap), and the score scale of every layer
    "qwen2_swa": ([(None, None), (None, None), (8, None), (8, None)], 16**-0.5),
    "qwen2_layer_types": ([(12, None), (None, None), (12, None), (None, None)], 16**-0.5),
    "qwen3_swa": ([(None, None), (8, None), (8, None), (8, None)], 32**-0.5),
    "mistral_swa": ([(10, None)]*4, 16**-0.5),
    "gemma2": ([(8, 5.0), (None, 5.0), (8, 5.0), (None, 5.0)], 32**-0.5),
    "gemma3": ([(12, None), (None, None), (12, None), (None, None)], 24**-0.5),   # Gemma 3 does not cap scores
}

@pytest.mark.parametrize("family", FAMILIES)
def test_layer_attention(family, models):
    hf, model, _, cfg, path = models[family]
    layers, scale = EXPECTED[family]
    assert cfg.layer_attentions == [LayerAttention(w, c, scale) for w, c in layers]
    assert [cfg.layer_attention(i) for i in range(4)] == cfg.layer_attentions
    assert all(math.isclose(a.scale, scale) for a in cfg.layer_attentions)
    assert ModelConfig.from_hf(hf.config).layer_attentions == cfg.layer_attentions   # the object reads as its JSON
    hf_types = getattr(hf.config, "layer_types", None) or ["sliding_attention"]*4    # Mistral: every layer
    assert [a.window is not None for a in cfg.layer_attentions] == [t == "sliding_attention" for t in hf_types]

def test_gemma_fields(models):
    g2, g3 = models["gemma2"][3], models["gemma3"][3]
    assert (g2.final_logit_softcapping, g2.hidden_act, g2.qk_norm, g2.tie_word_embeddings) == (10.0, "gelu_pytorch_tanh",
                                                                                               False, True)
    assert (g3.rope_theta, g3.rope_scaling["rope_type"], g3.rope_local_theta, g3.qk_norm) == (1e6, "linear", 1e4, True)
    assert g3.final_logit_softcapping == 15.0
    m3 = models["gemma3"][1]
    assert [l.self_attn.rotary[0] is m3.model.rotary_local for l in m3.model.layers] == [True, False, True, False]

def test_gemma_is_left_to_torch_by_the_cpu_fusion(models):
    "The C++ fast path rewrites Llama-family layers only; a Gemma model keeps its own and its logits."
    from pagednb.cpu_ops import fuse_for_cpu
    hf, model, *_ = models["gemma2"]
    x = _prompt(20, 4)
    with torch.inference_mode(): before = model.compute_logits(model(x, torch.arange(20), NoCacheAttention([20])))
    assert fuse_for_cpu(model) == 0
    with torch.inference_mode(): after = model.compute_logits(model(x, torch.arange(20), NoCacheAttention([20])))
    torch.testing.assert_close(after, before)

def test_sliding_llama_family_still_fuses(tmp_path):
    "A sliding-window Qwen2 is still a Llama-family model: every layer gets the C++ fast path, same logits."
    from pagednb.cpu_ops import fuse_for_cpu, cpu_ops
    if cpu_ops() is None: pytest.skip("the C++ ops do not build here")
    hf = tiny_hybrid_model("qwen2_swa", tmp_path)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    assert fuse_for_cpu(model) == 4
    x = _prompt(37, 5)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(model(x, torch.arange(37), NoCacheAttention([37]))),
                                   hf(x[None]).logits[0], atol=1e-4, rtol=1e-4)

# --- config.json: what transformers reads, and what it refuses

BASE = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=4, num_attention_heads=2)

def _windows(d): return [a.window for a in ModelConfig.from_hf(d).layer_attentions]

def test_qwen_use_sliding_window():
    q = dict(BASE, model_type="qwen2", sliding_window=8, max_window_layers=3)
    assert _windows(q) == [None]*4                                       # use_sliding_window false: no window
    assert _windows(dict(q, use_sliding_window=True)) == [None]*3 + [8]
    assert _windows(dict(q, model_type="qwen3", use_sliding_window=True, max_window_layers=0)) == [8]*4
    assert _windows(dict(q, use_sliding_window=True, sliding_window=None)) == [None]*4
    real = dict(q, use_sliding_window=False, sliding_window=131072, max_window_layers=28)   # Qwen2.5's config.json
    assert _windows(real) == [None]*4

def test_mistral_and_llama():
    m = dict(BASE, model_type="mistral")
    assert _windows(dict(m, sliding_window=4096)) == [4096]*4 and _windows(dict(m, sliding_window=None)) == [None]*4
    assert _windows(m) == [None]*4
    assert _windows(dict(BASE, model_type="llama", sliding_window=4096)) == [None]*4       # Llama has no window

def test_gemma_patterns():
    g2 = dict(BASE, model_type="gemma2", sliding_window=16)
    assert _windows(g2) == [16, None, 16, None]
    g3 = dict(BASE, model_type="gemma3_text", num_hidden_layers=12, sliding_window=512, sliding_window_pattern=6,
              rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=dict(rope_type="linear", factor=8.0))
    assert _windows(g3) == ([512]*5 + [None])*2
    c = ModelConfig.from_hf(g3)             # the hub's older spelling of Gemma 3's RoPE
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling["factor"], c.tie_word_embeddings) == (1e6, 1e4, 8.0, True)
    assert (c.query_pre_attn_scalar, c.attn_logit_softcapping, c.final_logit_softcapping) == (256, None, None)
    assert _windows(dict(g3, layer_types=["full_attention"]*12)) == [None]*12      # layer_types wins

@pytest.mark.parametrize("kind", ["chunked_attention", "linear_attention"])
def test_unknown_layer_type(kind):
    d = dict(BASE, model_type="qwen3", layer_types=["full_attention"]*3 + [kind], sliding_window=8)
    with pytest.raises(ValueError, match=f"layer_types holds '{kind}'; pagednb supports full_attention and "
                                         "sliding_attention"):
        ModelConfig.from_hf(d)

@pytest.mark.parametrize("window", [0, -4])
def test_window_under_one(window):
    with pytest.raises(ValueError, match=rf"sliding_window={window}; it must be a whole number of tokens, at least 1"):
        ModelConfig.from_hf(dict(BASE, model_type="mistral", sliding_window=window))
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf(dict(BASE, model_type="gemma2", sliding_window=window))

def test_layer_types_length():
    d = dict(BASE, model_type="gemma3_text", sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"layer_types has 2 entries; it needs one per layer \(num_hidden_layers=4\)"):
        ModelConfig.from_hf(d)

def test_sliding_layers_without_a_window():
    d = dict(BASE, model_type="qwen2", layer_types=["sliding_attention"]*4, sliding_window=8)   # use_sliding_window off
    with pytest.raises(ValueError, match="sliding_attention layers but no sliding_window"): ModelConfig.from_hf(d)

def test_bidirectional_and_activation_refused(tmp_path):
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(dict(BASE, model_type="gemma3_text", use_bidirectional_attention=True))
    tiny_hybrid_model("gemma2", tmp_path)
    d = json.loads((tmp_path/"config.json").read_text())
    (tmp_path/"config.json").write_text(json.dumps(dict(d, hidden_activation="relu2")))
    with pytest.raises(ValueError, match="hidden_activation='relu2' is not supported"): load_model(tmp_path, device="cpu")

def test_window_convention():
    "A window of `w` lets a query see `w` tokens, itself included (transformers: kv_idx > q_idx - w)."
    m = window_mask(10, 10, 4)
    assert m[9].nonzero().flatten().tolist() == [6, 7, 8, 9] and m[2].nonzero().flatten().tolist() == [0, 1, 2]
    q, k, v = torch.randn(1, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)      # one query at position 5
    torch.testing.assert_close(attend(q, k, v, LayerAttention(window=2, scale=8**-0.5)),
                               attend(q, k[-2:], v[-2:]))
