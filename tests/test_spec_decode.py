"Speculative decoding: identical greedy outputs, exact rejection sampling, and block accounting after rollbacks."
import pytest, torch
from pagednb.engine import LLM
from pagednb.sampling import SamplingParams
from pagednb.model import load_model
from helpers import chat_ids
from pagednb.spec_decode import rejection_accept, first_token_histogram, chi_square, ngram_propose, parse_speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "model": "self", "num_layers": 29, "num_speculative_tokens": 3}
TEXTS = ["Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
         "Repeat after me: one two three four five six seven eight nine ten.",
         "What is the capital of France?",
         "Write the word 'hello' five times, separated by spaces."]

@pytest.fixture(scope="module")
def parts(): return load_model()

@pytest.fixture(scope="module")
def prompts(parts):
    return chat_ids(parts[1], TEXTS)

@pytest.fixture(scope="module")
def reference(parts, prompts):
    llm = LLM(parts, log=False, max_model_len=512)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)]

def all_free(llm):
    bm = llm.engine.block_manager
    assert all(bm.block_state(i) in ("free", "cached") for i in range(bm.num_blocks)); bm.check_invariants([])

@pytest.mark.parametrize("cfg", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_greedy_identical(cfg, parts, prompts, reference):
    llm = LLM(parts, log=False, max_model_len=512, speculative_config=cfg)
    e, seen = llm.engine, []
    def check(engine, plan, sampled):                       # ref counts exact after every rollback
        engine.block_manager.check_invariants(engine.scheduler.running); seen.append(getattr(plan, "spec", {}))
    e.on_step = check
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)]
    assert got == reference
    m = llm.get_metrics()
    assert m["spec_num_draft_tokens"] > 0 and m["spec_num_accepted_tokens"] > 0
    assert 0 < m["spec_acceptance_rate"] <= 1 and len(m["spec_acceptance_per_position"]) == cfg["num_speculative_tokens"]
    assert any(r["num_accepted"] < len(r["proposed"]) for st in seen for r in st.values())    # some rollbacks happened
    all_free(llm)

def test_ends_mid_proposal(parts, prompts, reference):
    "A stop string or max_tokens inside an accepted run of drafts ends the sequence exactly where plain decoding would."
    plain = LLM(parts, log=False, max_model_len=512)
    spec = LLM(parts, log=False, max_model_len=512, speculative_config=NGRAM)
    text = parts[1].decode(reference[0], skip_special_tokens=True)
    stop = text.split()[4]
    for sp in [SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0, max_tokens=30, stop=[stop])]:
        a = plain.generate(prompts[:2], sp, use_tqdm=False); b = spec.generate(prompts[:2], sp, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in a] == \
               [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in b]
    all_free(spec)

def test_mixed_batch_prefix_caching_and_sampling(parts, prompts, reference):
    "Speculating and non-speculating sequences in one batch (logprobs turns it off), with prefix caching and seeded sampling."
    llm = LLM(parts, log=False, max_model_len=512, speculative_config=NGRAM, enable_prefix_caching=True)
    sps = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0, max_tokens=20, logprobs=2),
           SamplingParams(temperature=0.8, seed=3, max_tokens=20), SamplingParams(temperature=0, max_tokens=20)]
    a = llm.generate(prompts, sps, use_tqdm=False)
    assert [a[i].outputs[0].token_ids for i in (0, 1, 3)] == [reference[i] for i in (0, 1, 3)]
    b = llm.generate(prompts, sps, use_tqdm=False)                        # prefix-cache hits this time
    assert a[2].outputs[0].token_ids == b[2].outputs[0].token_ids        # seeded: reproducible with speculation
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    all_free(llm)

def test_disable_by_batch_size(parts, prompts, reference):
    llm = LLM(parts, log=False, max_model_len=512, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)]
    assert got == reference
    m = llm.get_metrics()
    assert m["spec_num_draft_tokens"] > 0          # once fewer than 2 are left running, speculation comes back on
    llm2 = LLM(parts, log=False, max_model_len=512, speculative_config={**NGRAM, "disable_by_batch_size": 1})
    llm2.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm2.get_metrics()["spec_num_draft_tokens"] == 0

def test_rejection_sampling_is_exact():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0]]).repeat(2, 1)
    q = torch.tensor([0.05, 0.05, 0.3, 0.3, 0.3])
    stat, pval = chi_square(first_token_histogram(p, q, n=6000, seed=1), p[0])
    assert pval > 1e-3, (stat, pval)
    def biased(p, drafts, q=None, generator=None): return list(drafts)     # accepts every draft: samples q, not p
    stat, pval = chi_square(first_token_histogram(p, q, n=6000, seed=1, sampler=biased), p[0])
    assert pval < 1e-6

def test_rejection_with_point_mass_drafts():
    "n-gram drafts are point masses: accepted with probability p(d)."
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    g = torch.Generator().manual_seed(0)
    kept = [len(rejection_accept(p, [0], generator=g)) for _ in range(4000)]
    assert abs(sum(k == 2 for k in kept)/4000 - 0.7) < 0.03

def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert ngram_propose([1, 2, 3, 9, 4, 4, 2, 3], 3, max_n=2) == [9, 4, 4]
    assert ngram_propose([7, 8], 3) == []

def test_bad_configs(parts, tmp_path):
    with pytest.raises(ValueError, match="method='eagle' is unknown"): LLM(parts, log=False, max_model_len=256, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens=0"): parse_speculative_config({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min \\(4\\) must be <= prompt_lookup_max"): parse_speculative_config({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="could not load the draft model"):
        LLM(parts, log=False, max_model_len=256, speculative_config={"method": "draft_model", "model": str(tmp_path/"nothing")})
    from helpers import tiny_hf_model
    tiny_hf_model("llama", tmp_path/"tiny", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary \\(300 tokens\\) differs from the target's \\(49152\\)"):
        LLM(parts, log=False, max_model_len=256, speculative_config={"method": "draft_model", "model": str(tmp_path/"tiny")})
