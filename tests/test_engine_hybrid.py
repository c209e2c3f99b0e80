"""The paged engine on models with sliding-window layers, against Hugging Face `generate`: greedy outputs token-equal
under the defaults, two block sizes, no prefix caching, 16-token chunks, a pool so small it preempts, and n-gram
speculation; blocks that leave a window go back to the pool, none leak."""
import pytest, torch
from pagednb.engine import LLM
from pagednb.sampling import SamplingParams
from pagednb.model import load_model
from pagednb.hybrid_kv import layer_windows, model_kv_groups, need_blocks
from helpers import tiny_hybrid_model, HYBRID_FAMILIES

MAX_NEW = 40
LENGTHS = (7, 29, 53, 90)                        # from under one window to several windows long

@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    "A tiny random model of the family, its engine parts, prompts, and HF's greedy continuations."
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_hybrid_model(request.param, path)
    parts = load_model(path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(1)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    ref = [_hf_greedy(hf, p) for p in prompts]
    return request.param, parts, prompts, ref

def _hf_greedy(hf, p, n=MAX_NEW):
    x = torch.tensor([p])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[0, len(p):].tolist()

def check_all_free(llm):
    "Every block is free or cached once the engine is idle, and every group's invariants hold."
    bm = llm.engine.block_manager
    assert all(bm.block_state(i) in ("free", "cached") for i in range(bm.num_blocks) if i != bm.null_block)
    bm.check_invariants([])

def run(parts, prompts, sp=None, **kw):
    llm = LLM(parts, log=False, **kw)
    sp = sp or SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)     # EOS masked, as min_new_tokens
    outs = llm.generate(prompts, sp, use_tqdm=False)
    check_all_free(llm)
    return llm, [o.outputs[0].token_ids for o in outs]

CASES = {
    "defaults": dict(max_model_len=256),
    "block_size_4": dict(max_model_len=256, block_size=4),
    "block_size_32": dict(max_model_len=256, block_size=32),
    "prefix_caching_off": dict(max_model_len=256, enable_prefix_caching=False),
    "chunks_16": dict(max_model_len=256, max_num_batched_tokens=16),
    "preemption": dict(max_model_len=160, max_num_batched_tokens=16),          # the pool: one request's worth
    "ngram": dict(max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 3}),
    "draft_model": dict(max_model_len=256, speculative_config={"method": "draft_model", "model": "self",
                                                               "num_layers": 2, "num_speculative_tokens": 3}),
}

# every family under the defaults; each other case on the families that exercise it most (windows that span one
# layer group or all layers, Qwen's max_window_layers, Gemma's soft caps and local RoPE), so that every case meets
# a model with windows on some layers and one with windows on all or on the later ones
SPREAD = {"block_size_4": ("qwen2_swa", "gemma2", "mistral_swa"), "block_size_32": ("qwen2_layer_types", "gemma3"),
          "prefix_caching_off": ("qwen3_swa", "gemma2"), "chunks_16": ("qwen2_swa", "gemma3", "mistral_swa"),
          "preemption": ("qwen2_layer_types", "gemma2", "mistral_swa"), "ngram": ("qwen3_swa", "gemma3"),
          "draft_model": ("qwen2_swa", "gemma2")}

PAIRS = [(f, "defaults") for f in HYBRID_FAMILIES] + [(f, c) for c, fs in SPREAD.items() for f in fs]
PAIRS.sort(key=lambda p: list(HYBRID_FAMILIES).index(p[0]))          # one family's model is built once

@pytest.mark.parametrize("family,case", PAIRS, indirect=["family"])
def test_greedy_matches_hf(family, case):
    name, parts, prompts, ref = family
    kw = dict(CASES[case])
    if case == "preemption": kw["num_gpu_blocks_override"] = _one_request(parts, **kw) + 2
    llm, got = run(parts, prompts, **kw)
    assert got == ref, f"{name} under {case}"
    if case == "preemption" and None in layer_windows(parts[2]): assert llm.get_metrics()["num_preemptions"] > 0

def _one_request(parts, max_model_len, max_num_batched_tokens, block_size=16):
    "The blocks one request of `max_model_len` needs at most, over every group, the null block with them."
    groups = model_kv_groups(parts[2])
    return need_blocks(groups, block_size, max_model_len, max_num_batched_tokens) or -(-max_model_len//block_size)


def test_windows_everywhere_outlive_a_full_cache(tmp_path):
    "A window in every layer: 220 tokens in a pool whose blocks would hold 40 as a full cache, never preempted."
    hf = tiny_hybrid_model("mistral_swa", tmp_path)
    parts = load_model(tmp_path, dtype="float32", device="cpu")
    kw = dict(max_model_len=256, block_size=4, max_num_batched_tokens=16)
    pool = _one_request(parts, **kw) + 1
    p = list(range(5, 25))
    sp = SamplingParams(temperature=0, max_tokens=200, min_tokens=200)
    llm, got = run(parts, [p], sp, num_gpu_blocks_override=pool, **kw)
    assert pool*4 < len(p) + 200
    assert llm.get_metrics()["num_preemptions"] == 0
    assert got == [_hf_greedy(hf, p, 200)]

def test_draft_logits_carry_the_final_soft_cap(tmp_path):
    "A truncated draft of Gemma 2 squashes its logits with the target's final soft cap, as the target does."
    from pagednb.spec_decode import TruncatedDraft
    tiny_hybrid_model("gemma2", tmp_path)
    model = load_model(tmp_path, dtype="float32", device="cpu")[0]
    draft = TruncatedDraft(model, 1)
    hidden = torch.randn(3, model.config.hidden_size) * 1000
    got = draft.compute_logits(hidden)
    assert model.softcap is not None and got.abs().max() <= model.softcap
    torch.testing.assert_close(got, model.compute_logits(hidden))
