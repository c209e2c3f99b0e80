"vLLM's engine API on pagednb (knobs, outputs, generation defaults), and bad input that harms no one else."
import json, os, subprocess, sys, textwrap
from pathlib import Path
import pytest, torch
from pagednb import engine as E
from pagednb.engine import LLM, EngineDeadError
from pagednb.sampling import SamplingParams, Logprob
from pagednb.model import load_model, resolve_model

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

@pytest.fixture(scope="module")
def parts(): return load_model()

@pytest.fixture(scope="module")
def llm(parts): return LLM(parts, log=False, max_model_len=512, kv_cache_memory_bytes=64 << 20)

@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()

def hf_greedy(hf, ids, n=8, **kw):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()

def all_free(llm):
    bm = llm.engine.block_manager
    bm.check_invariants([])
    return bm.num_used_blocks == 0 and not llm.engine.requests and not llm.engine.has_unfinished_requests()

# --- knobs ---------------------------------------------------------------------------------------------------

def test_vllm_knobs_accepted(parts):
    llm = LLM(parts, log=False, max_model_len=256, kv_cache_memory_bytes=16 << 20, tensor_parallel_size=1,
              pipeline_parallel_size=1, enforce_eager=True, trust_remote_code=True, kv_cache_dtype="auto",
              disable_log_stats=True, max_logprobs=5, revision=None, generation_config="vllm", seed=1)
    assert llm.llm_engine is llm.engine and llm.engine.max_logprobs == 5
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

@pytest.mark.parametrize("knob,value", [("tensor_parallel_size", 2), ("pipeline_parallel_size", 4),
                                        ("data_parallel_size", 2), ("quantization", "awq")])
def test_vllm_only_values_say_run_on_vllm(parts, knob, value):
    with pytest.raises(NotImplementedError, match=f"{knob}={value!r}.*run this on vLLM"):
        LLM(parts, log=False, **{knob: value})

@pytest.mark.parametrize("kw,match", [(dict(max_model_length=512), "did you mean max_model_len"),
                                      (dict(gpu_memory_utilisation=0.5), "did you mean gpu_memory_utilization"),
                                      (dict(enable_prefix_cache=True), "enable_prefix_caching")])
def test_unknown_keyword_names_the_closest(parts, kw, match):
    with pytest.raises(TypeError, match=match): LLM(parts, log=False, **kw)

@pytest.mark.parametrize("kw,match", [(dict(block_size=0), "block_size"), (dict(max_model_len=0), "max_model_len=0"),
                                      (dict(gpu_memory_utilization=0), "gpu_memory_utilization=0"),
                                      (dict(max_logprobs=-3), "max_logprobs=-3"), (dict(seed=2**70), "seed="),
                                      (dict(generation_config="nowhere"), "generation_config='nowhere'")])
def test_bad_knob_values(parts, kw, match):
    with pytest.raises(ValueError, match=match): LLM(parts, log=False, max_model_len=kw.pop("max_model_len", 256), **kw)

def test_generation_config_defaults(tmp_path):
    src = resolve_model(None)
    for f in src.iterdir():
        if f.name != "generation_config.json": (tmp_path/f.name).symlink_to(f)
    (tmp_path/"generation_config.json").write_text(json.dumps(dict(temperature=0.3, top_p=0.9, max_new_tokens=7)))
    llm = LLM(str(tmp_path), log=False, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.3, 0.9, 7)
    assert len(llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) <= 7     # None takes the defaults
    plain = LLM(str(tmp_path), log=False, max_model_len=256, kv_cache_memory_bytes=16 << 20, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    llm.shutdown(); plain.shutdown()

# --- outputs -------------------------------------------------------------------------------------------------

def test_text_prompts_get_special_tokens_as_vllm_adds_them(llm):
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer(PROMPT)["input_ids"]           # add_special_tokens=True

def test_stop_reason_and_include_stop_str(llm):
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ref.stop_reason is None and ref.finish_reason == "length"
    word = ref.text.split()[2]
    cut = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[word]), use_tqdm=False)[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", word) and word not in cut.text
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[word], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text.endswith(word) and kept.text == cut.text + word
    tok = ref.token_ids[3]
    by_id = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok]), use_tqdm=False)[0].outputs[0]
    assert (by_id.finish_reason, by_id.stop_reason, by_id.token_ids[-1]) == ("stop", tok, tok)

def test_prompt_logprobs_match_hf_across_chunks_and_cache(parts, hf):
    llm = LLM(parts, log=False, max_model_len=512, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=32)
    ids = parts[1](("A page table maps virtual pages to physical frames. " * 4).strip())["input_ids"]
    llm.generate([ids], GREEDY, use_tqdm=False)                                  # its pages are now cached
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    with torch.no_grad(): ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for i in range(1, len(ids)):
        e = out.prompt_logprobs[i]
        assert ids[i] in e and isinstance(e[ids[i]], Logprob) and len(e) <= 3
        assert e[ids[i]].logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=2e-3)
        assert e[ids[i]].rank == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1

def test_repetition_penalty_matches_hf(parts, hf, llm):
    ids = parts[1]("one two three one two three one two three")["input_ids"]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5)
    got = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(hf, ids, 10, repetition_penalty=1.5)
    assert got != llm.generate([ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids

def test_reset_prefix_cache(llm):
    llm.generate([[7] * 100], GREEDY, use_tqdm=False)
    assert llm.engine.block_manager.num_cached_free_blocks > 0
    assert llm.reset_prefix_cache() and llm.engine.block_manager.num_cached_free_blocks == 0
    e = llm.engine
    e.add_request("held", [9] * 100, SamplingParams(temperature=0, max_tokens=4))
    e.step()                                                            # its full prompt pages are registered, and held
    assert not llm.reset_prefix_cache()                                 # vLLM's answer while pages are in use
    while e.has_unfinished_requests(): e.step()
    assert llm.reset_prefix_cache() and all_free(llm)

# --- bad input offline: validated whole, before anything is queued --------------------------------------------

@pytest.mark.parametrize("bad,field", [(dict(top_k=2**70), "top_k"), (dict(top_k=50_000), "top_k"),
                                       (dict(logprobs=10**6), "logprobs"), (dict(seed=2**70), "seed"),
                                       (dict(prompt_logprobs=100), "prompt_logprobs"),
                                       (dict(logit_bias={10**9: 1.0}), "logit_bias"),
                                       (dict(allowed_token_ids=[-1]), "allowed_token_ids")])
def test_bad_params_queue_nothing(llm, hf, bad, field):
    make = lambda: SamplingParams(temperature=1.0, max_tokens=4, **bad)
    with pytest.raises(ValueError, match=field):                              # at construction, or validating prompt 1
        llm.generate([PROMPT, "Hi"], [GREEDY, make()], use_tqdm=False)
    assert all_free(llm)
    ids = llm.tokenizer(PROMPT)["input_ids"]
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, ids)

def test_extreme_values_that_run(llm):
    tiny_t = llm.generate(PROMPT, SamplingParams(temperature=1e-38, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert tiny_t.outputs[0].token_ids == llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    two = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=2**64 - 1, n=2, max_tokens=4), use_tqdm=False)[0]
    assert len(two.outputs) == 2 and all(o.token_ids for o in two.outputs)
    one = llm.generate(PROMPT, SamplingParams(temperature=0, logprobs=True, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert all(len(e) == 1 for e in one.logprobs)
    assert all_free(llm)

def test_a_request_that_fails_in_a_step_fails_alone(llm, monkeypatch):
    real = E.process_logits
    def flaky(logits, params, *a):
        if any(p.seed == 666 for p in params): raise RuntimeError("boom")
        return real(logits, params, *a)
    prompts = [PROMPT, "Hi there", "Name three colours."]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    solo_seeded = llm.generate(prompts[2], seeded, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(E, "process_logits", flaky)
    bad = SamplingParams(temperature=0.7, seed=666, max_tokens=8, repetition_penalty=1.2)
    outs = llm.generate(prompts + [PROMPT], [GREEDY, GREEDY, seeded, bad], use_tqdm=False)
    assert outs[3].outputs[0].finish_reason == "error" and "boom" in outs[3].error
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone[:2] and outs[0].error is None
    assert outs[2].outputs[0].token_ids == solo_seeded                         # its generator was put back
    assert all_free(llm)
    monkeypatch.setattr(E, "process_logits", real)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == alone

def test_engine_that_fails_for_everyone_gives_up(parts, monkeypatch):
    "The model itself fails (a one-token probe too): no request is to blame, and after 3 such steps the engine ends."
    llm = LLM(parts, log=False, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    lost = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    monkeypatch.setattr(type(llm.engine.model), "forward", lost)
    outs = []
    with pytest.raises(EngineDeadError, match="device lost"):
        for _ in range(3): outs += llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    with pytest.raises(EngineDeadError): llm.engine.step()

def test_a_bad_request_again_and_again_cannot_end_the_engine(llm, monkeypatch):
    "A request that fails alone is blamed, not counted against the engine: ten in a row, and the next one runs."
    real = E.process_logits
    def flaky(logits, params, *a):
        if any(p.seed == 666 for p in params): raise RuntimeError("boom")
        return real(logits, params, *a)
    monkeypatch.setattr(E, "process_logits", flaky)
    bad = SamplingParams(temperature=0.7, seed=666, max_tokens=4, repetition_penalty=1.2)
    for _ in range(10): assert llm.generate(PROMPT, bad, use_tqdm=False)[0].outputs[0].finish_reason == "error"
    assert llm.engine.dead is None and llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert all_free(llm)

def test_n_greater_than_one_rolls_back_its_forks(llm, monkeypatch):
    real, calls = E.sample, []
    def once(logits, params, *a):
        calls.append(len(params))
        if len(calls) == 1 and len(params) > 1: raise RuntimeError("first try fails")
        return real(logits, params, *a)
    monkeypatch.setattr(E, "sample", once)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.8, n=3, seed=3, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"                   # a lone request that raises is the culprit
    assert all_free(llm) and len(calls) == 1

# --- memory ----------------------------------------------------------------------------------------------------

def test_shutdown_and_context_manager(parts):
    with LLM(parts, log=False, max_model_len=256, kv_cache_memory_bytes=16 << 20) as llm:
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.runner.kv_cache is None
    with pytest.raises(EngineDeadError, match="shut down"): llm.generate(PROMPT, GREEDY, use_tqdm=False)

MEMORY_SCRIPT = textwrap.dedent('''
    import gc, json
    def rss(): return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 2**20
    from pagednb import LLM, SamplingParams
    llm = LLM(log=False)
    built = rss()
    llm.generate(["Hello"] * 4, SamplingParams(max_tokens=8), use_tqdm=False)
    ran = rss()
    del llm; gc.collect()
    for i in range(3):
        llm = LLM(log=False)
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
        del llm; gc.collect()
    print(json.dumps(dict(built=built, ran=ran, after_three=rss())))
''')

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_engine_memory_is_paid_as_used_and_given_back():
    r = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print(m)
    assert m["built"] <= 1.5, f"LLM() holds {m['built']:.2f} GiB before any work"
    assert m["after_three"] < 2.5, f"three engines built and deleted leave {m['after_three']:.2f} GiB"
