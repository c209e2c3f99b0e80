"The paged engine against Hugging Face `generate`: greedy outputs token-identical under every engine feature."
import pytest, torch
from pagednb.engine import LLM, LLMEngine
from pagednb.sampling import SamplingParams
from pagednb.model import load_model, resolve_model
from helpers import chat_ids

MAX_NEW = 24
SYSTEM = ("You are a careful assistant for a class on operating systems. Answer in plain words, give one "
          "small example, and keep every answer short. ")*2
QUESTIONS = ["Hi.", "What is a page table?", "Name two scheduling policies.",
             "Explain what a cache miss is, and why it costs time, to a new student who knows some Python.",
             "What is 12 times 12?", "Write one sentence about the moon.",
             "List three uses of hashing in systems software, each with a one-line reason why hashing helps there.",
             "Why do operating systems use virtual memory instead of giving programs physical addresses directly? Be brief."]

@pytest.fixture(scope="module")
def parts(): return load_model()

@pytest.fixture(scope="module")
def prompts(parts):
    return chat_ids(parts[1], [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS])

@pytest.fixture(scope="module")
def reference(parts, prompts):
    "Hugging Face greedy `generate`, one prompt at a time (no padding effects)."
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()
    eos = parts[1].eos_token_id
    return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(p):].tolist()
            for p in prompts]

def check_all_free(llm):
    bm = llm.engine.block_manager
    assert all(bm.block_state(i) in ("free", "cached") for i in range(bm.num_blocks))
    bm.check_invariants([])

def run(parts, prompts, **kw):
    llm = LLM(parts, log=False, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    check_all_free(llm)
    return llm, [o.outputs[0].token_ids for o in outs]

CASES = {
    "defaults": dict(max_model_len=1024),
    "prefix_caching_off": dict(max_model_len=1024, enable_prefix_caching=False),
    "chunked_prefill_32": dict(max_model_len=1024, max_num_batched_tokens=32),
    "no_chunking": dict(max_model_len=1024, enable_chunked_prefill=False),
    "preemption": dict(max_model_len=192, num_gpu_blocks_override=24, max_num_batched_tokens=128),
    "block_size_8": dict(max_model_len=1024, block_size=8),
    "shortest_first": dict(max_model_len=1024, max_num_batched_tokens=32, scheduling_policy="shortest"),
    "shortest_preemption": dict(max_model_len=192, num_gpu_blocks_override=24, max_num_batched_tokens=128,
                                scheduling_policy="shortest"),
    "decode_step_budget": dict(max_model_len=1024, max_num_batched_tokens=256, decode_step_budget=16),
    "ttft_slo_all_late": dict(max_model_len=1024, max_num_batched_tokens=32, scheduling_policy="shortest",
                              ttft_slo=1e-6),
}

@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf(case, parts, prompts, reference):
    llm, got = run(parts, prompts, **CASES[case])
    assert got == reference
    m = llm.get_metrics()
    if case == "prefix_caching_off": assert m["prefix_cache_hits"] == 0
    # every prompt is admitted in the first step: the system prompt's pages, filled in that step, are shared in it
    if case == "defaults": assert m["prefix_cache_hits"] >= 48 * (len(prompts) - 1)
    if "preemption" in case: assert m["num_preemptions"] > 0

def test_prefix_cache_hits_skip_work(parts, prompts, reference):
    llm = LLM(parts, log=False, max_model_len=1024)
    first = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    rest = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == reference
    assert all(o.num_cached_tokens >= 48 for o in rest)                   # the system prompt's full pages
    check_all_free(llm)

def test_n3_seeded_sampling_reproducible(parts, prompts):
    sp = SamplingParams(n=3, temperature=0.9, top_k=50, top_p=0.95, seed=7, max_tokens=12)
    llm = LLM(parts, log=False, max_model_len=1024, num_gpu_blocks_override=128)
    a = llm.generate(prompts[1], sp, use_tqdm=False)[0]
    b = llm.generate([prompts[0], prompts[1], prompts[2]], [SamplingParams(temperature=0.5, max_tokens=12), sp, sp], use_tqdm=False)[1]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1                   # the three children differ
    check_all_free(llm)

def test_stop_strings_min_and_max_tokens(parts, prompts, reference):
    llm = LLM(parts, log=False, max_model_len=1024)
    full = llm.tokenizer.decode(reference[1], skip_special_tokens=True)
    word = full.split()[3]
    out = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[word]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and word not in out.text and full.startswith(out.text)
    out = llm.generate(prompts[4], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    out = llm.generate(prompts[4], SamplingParams(temperature=0, max_tokens=40, min_tokens=40), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 40
    check_all_free(llm)

def test_streaming_and_abort(parts, prompts, reference):
    llm = LLM(parts, log=False, max_model_len=1024)
    deltas = list(llm.stream(prompts[3], SamplingParams(temperature=0, max_tokens=MAX_NEW)))
    assert [t for d in deltas for t in d.token_ids] == reference[3] and deltas[-1].finished
    e = llm.engine
    e.add_request("a", prompts[5], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    e.add_request("b", prompts[6], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3): e.step()
    e.abort_request("a")
    outs = {o.request_id: o for _ in range(2) for o in e.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    e.abort_request("b")
    while e.has_unfinished_requests(): e.step()
    check_all_free(llm)

def test_logprobs(parts, prompts):
    llm = LLM(parts, log=False, max_model_len=1024)
    o = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 4
    for t, lp in zip(o.token_ids, o.logprobs):
        assert t in lp and len(lp) == 3 and lp[t].rank == 1                # greedy: the chosen token is the top one
        assert max(v.logprob for v in lp.values()) == lp[t].logprob
        assert sorted(v.rank for v in lp.values()) == [1, 2, 3]
        assert lp[t].decoded_token == parts[1].decode([t])
    assert o.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)))

def test_bad_input(parts, prompts):
    llm = LLM(parts, log=False, max_model_len=256)
    with pytest.raises(ValueError, match="prompt 1: the prompt has 300 tokens; with max_model_len=256"):
        llm.generate([prompts[0], [5]*300], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()                          # validated before any work
    with pytest.raises(ValueError, match="the prompt is empty"): llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.top_k"): SamplingParams(top_k=-5)
    with pytest.raises(ValueError, match="attention_backend='flash'.*'torch', 'triton'"): LLM(parts, attention_backend="flash", log=False)
    with pytest.raises(ValueError, match=r"fewer than one sequence of max_model_len=1024.*kv_cache_memory_bytes >= "):
        LLM(parts, max_model_len=1024, kv_cache_memory_bytes=1 << 20, log=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"): LLM(parts, max_model_len=1024, max_num_batched_tokens=64, enable_chunked_prefill=False, log=False)
    with pytest.raises(ValueError, match="SamplingParams"): llm.generate([prompts[0]], [SamplingParams(), SamplingParams()], use_tqdm=False)

def test_startup_log_line(parts, capsys):
    LLM(parts, max_model_len=512, num_gpu_blocks_override=100)
    out = capsys.readouterr().out
    assert "KV cache: 100 blocks × 16 tokens = 1600 tokens (" in out and "max concurrency at max_model_len: 3.12" in out

def test_triton_backend_tiny_model(tmp_path):
    "The engine end to end with the Triton kernels (interpreter on CPU) on a tiny random Llama, against HF."
    from helpers import tiny_hf_model
    hf = tiny_hf_model("llama", tmp_path, num_attention_heads=4, num_key_value_heads=2, hidden_size=256, intermediate_size=256)
    parts = load_model(tmp_path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 33)]
    llm = LLM(parts, attention_backend="triton", log=False, max_model_len=128, num_gpu_blocks_override=24, block_size=8,
              max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        x = torch.tensor([p])       # an explicit mask: random prompts may contain the pad id, which generate would mask out
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
    check_all_free(llm)

def test_cpu_kernel_on_and_off(parts, prompts, reference, monkeypatch):
    "On a CPU the torch backend's short sequences run on the C++ kernel; switched off, SDPA gives the same tokens."
    from pagednb.cpu_attention import cpu_kernel
    if cpu_kernel() is None: pytest.skip("no C++ compiler here: the kernel is unavailable (the fallback is what every other test ran)")
    llm, got = run(parts, prompts, max_model_len=1024)
    assert got == reference and llm.engine.runner.attn.path == "cpu"      # the last step ran on the kernel
    monkeypatch.setenv("PAGEDNB_CPU_KERNEL", "0")
    llm, got = run(parts, prompts, max_model_len=1024)
    assert got == reference and llm.engine.runner.attn.path == "torch"

KEPT_TABLES = {
    "preemption": (dict(max_model_len=192, num_gpu_blocks_override=24, max_num_batched_tokens=128), {}),
    "forks_n3": (dict(max_model_len=1024, num_gpu_blocks_override=96), dict(n=3, temperature=0.8, seed=1)),
    "ngram_drafts": (dict(max_model_len=1024, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                  "prompt_lookup_max": 3}), {}),
}

@pytest.mark.parametrize("case", list(KEPT_TABLES))
def test_block_tables_kept_across_steps_equal_rebuilt_ones(case, parts, prompts):
    "The runner's `BlockTables` (written only where a table changed) give every step the tables built afresh."
    from pagednb.runner import block_table_tensor
    kw, sp = KEPT_TABLES[case]
    llm = LLM(parts, log=False, **kw)
    runner, seen = llm.engine.runner, []
    prepare = runner.prepare_inputs
    def checked(plan):
        x = prepare(plan)
        fresh = block_table_tensor([s.seq.block_table for s in plan.scheduled])
        assert torch.equal(x.block_tables, fresh)
        seen.append(len(plan.scheduled))
        return x
    runner.prepare_inputs = checked
    llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, **({"temperature": 0} | sp)), use_tqdm=False)
    assert len(seen) >= MAX_NEW and max(seen) > 1
    if case == "preemption": assert llm.get_metrics()["num_preemptions"] > 0
    check_all_free(llm)

def _first_token_steps(parts, threshold):
    "Steps from a short request's arrival to its first token, queued behind the first chunk of a 600-token prompt."
    eng = LLM(parts, log=False, max_num_batched_tokens=128, long_prefill_token_threshold=threshold).engine
    greedy = SamplingParams(temperature=0, max_tokens=2)
    eng.add_request("long", dict(prompt_token_ids=list(range(100, 700))), greedy)
    eng.step()
    eng.add_request("short", dict(prompt_token_ids=list(range(100, 110))), greedy)
    for n in range(1, 12):
        if any(o.request_id == "short" and o.outputs[0].token_ids for o in eng.step()): return n
        assert n > 1 or threshold == 0, "the short request waited behind the long prompt"

def test_a_long_prompt_shares_the_budget(parts):
    # pagednb's default: a running prompt takes half the budget while another request waits
    assert _first_token_steps(parts, None) == 1
    # vLLM's default (no cap): the short request waits for the long prompt's last chunk (472 tokens: 4 steps)
    assert _first_token_steps(parts, 0) == 4
    # vLLM's fixed cap
    assert _first_token_steps(parts, 32) == 1


def _first_tokens(parts, policy, lens=(300, 20, 150, 40)):
    "The order in which requests of these prompt lengths, arriving together, get their first token."
    eng = LLM(parts, log=False, max_num_batched_tokens=64, scheduling_policy=policy).engine
    greedy = SamplingParams(temperature=0, max_tokens=2)
    for i, n in enumerate(lens):
        eng.add_request(f"r{i}", dict(prompt_token_ids=list(range(100 + i, 100 + i + n))), greedy)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.outputs[0].token_ids and o.request_id not in order]
    return order

def test_shortest_first_on_a_burst(parts):
    assert _first_tokens(parts, "shortest") == ["r1", "r3", "r2", "r0"]
    # first come, first served: the 40-token prompt, last to arrive, waits for the 300- and 150-token ones
    assert _first_tokens(parts, "fcfs") == ["r1", "r2", "r0", "r3"]

def _steps_to_first_token(eng, rid):
    "Engine steps until request `rid` has its first token."
    for n in range(1, 100):
        if any(o.request_id == rid and o.outputs[0].token_ids for o in eng.step()): return n

def test_decode_step_budget_on_the_engine(parts):
    eng = LLM(parts, log=False, max_num_batched_tokens=256, decode_step_budget=16).engine
    decode_40 = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("a", dict(prompt_token_ids=list(range(100, 300))), decode_40)
    assert _steps_to_first_token(eng, "a") == 1                 # nothing decodes: the whole budget, one step
    eng.add_request("b", dict(prompt_token_ids=list(range(400, 600))), decode_40)
    assert _steps_to_first_token(eng, "b") == 14                # beside a's decode: 15 of b's tokens a step
    while eng.has_unfinished_requests(): eng.step()

def test_a_failed_step_takes_back_the_pages_it_shared_before_computing(parts, prompts, reference):
    "A prompt fails in the step where a second shares its system prompt's pages: the second starts over and is right."
    llm = LLM(parts, log=False, max_model_len=1024)
    execute, poison = llm.engine.runner.execute, prompts[0]
    def poisoned(plan):                                  # a forward that holds the first prompt raises before writing
        if any(list(sc.seq.token_ids[:len(poison)]) == poison for sc in plan.scheduled): raise RuntimeError("fault")
        return execute(plan)
    llm.engine.runner.execute = poisoned
    outs = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == reference[1]
    llm.engine.runner.execute = execute                  # the pages left in the cache are right ones, or none
    again = llm.generate(prompts[1:3], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference[1:3]
    check_all_free(llm)
