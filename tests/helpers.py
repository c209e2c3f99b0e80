"Tiny random-weight Hugging Face models of each supported family, saved to a folder."
import torch

FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama3": dict(model_type="llama", rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=64)),
    "mistral": dict(model_type="mistral"),
    "qwen2": dict(model_type="qwen2"),
    "smollm2_tied": dict(model_type="llama", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=32),                     # head_dim is not hidden_size / heads (16)
    "qwen3_tied": dict(model_type="qwen3", head_dim=24, tie_word_embeddings=True),
}

def tiny_hf_model(family="llama", path=None, seed=0, **kw):
    "Build a tiny random Hugging Face model of `family`; save it to `path` if given. Returns the model."
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(FAMILIES[family]); mt = spec.pop("model_type")
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_theta=10000.0)
    base.update(spec); base.update(kw)
    cfg = AutoConfig.for_model(mt, **base)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():                                  # biases are zero-initialised, Qwen3's q/k norms ones: make them count
        for n, p in m.named_parameters():
            if n.endswith("bias"): p.normal_(0, 0.1)
            if n.endswith(("q_norm.weight", "k_norm.weight")): p.normal_(1.0, 0.3)
    if path is not None: m.save_pretrained(path)
    return m

def chat_ids(tok, conversations):
    "Token ids of each conversation (a list of `{role, content}` messages, or one user message as a string), ready for the assistant's turn."
    convs = [[{"role": "user", "content": c}] if isinstance(c, str) else c for c in conversations]
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in convs]

def tiny_chat_model(path):
    "A tiny random Llama with SmolLM2's tokenizer and chat template, saved as a Hugging Face folder at `path`."
    import shutil
    from pagednb.model import embedded_model_path
    tiny_hf_model("llama", path, vocab_size=49152, max_position_embeddings=512)
    src = embedded_model_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src/f).exists(): shutil.copy(src/f, path/f)
    return path

# --- models whose layers attend differently: sliding windows, soft caps, Gemma

HYBRID_VOCAB, HYBRID_LAYERS = 512, 4
_HYBRID_BASE = dict(vocab_size=HYBRID_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=HYBRID_LAYERS,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

HYBRID_FAMILIES = {   # family -> (transformers config class name, its arguments, the window its sliding layers have)
    "qwen2_swa": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), 8),
    "qwen2_layer_types": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=12, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]), 12),
    "qwen3_swa": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, head_dim=32), 8),
    "mistral_swa": ("MistralConfig", dict(sliding_window=10), 10),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=32, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=10.0), 8),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                                        sliding_window_pattern=2, final_logit_softcapping=15.0,
                                        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=4.0,
                                                                                 rope_theta=1e6),
                                                             sliding_attention=dict(rope_type="default",
                                                                                    rope_theta=1e4))), 12),
}

def tiny_hybrid_model(family, path=None, seed=0):
    "A tiny random transformers model of `family` (`HYBRID_FAMILIES`), eager attention; saved to `path` if given."
    import transformers
    from transformers import AutoModelForCausalLM
    name, kw, _ = HYBRID_FAMILIES[family]
    cfg = getattr(transformers, name)(**_HYBRID_BASE, **kw)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():               # zero biases and Gemma's zero (or Qwen3's unit) norm gains would hide mistakes
        for n, p in m.named_parameters():
            if n.endswith("bias"): p.normal_(0, 0.1)
            if n.endswith("norm.weight"): p.normal_(0.0 if "gemma" in family else 1.0, 0.3)
    if path is not None: m.save_pretrained(path)
    return m


def prefill(bm, seq):
    "Admit `seq` on block manager `bm` with its cached prefix, compute the rest at once and cache it; the hits."
    hit = bm.get_computed_blocks(seq)
    bm.allocate(seq, seq.num_tokens - len(hit) * bm.block_size, hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq, seq.num_tokens)
    return hit
