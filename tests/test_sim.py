"""The capacity simulator (`09a_capacity`): memory as the engine sizes it, the real scheduler in simulated
time, and the seed article's arithmetic."""
import json
import pytest
from pagednb import sim as S
from pagednb.trace import Trace

def A100(**kw): return S.Simulator("Llama-2-13B", "A100-40GB", max_model_len=2048, log=False, **kw)

def test_seed_weights_are_65_percent_of_an_a100_40gb():
    m = A100().memory
    assert abs(m["weights"]/1e9 - 26.0) < 0.1 and abs(m["weights"]/40e9 - 0.65) < 0.01
    assert m["kv_bytes_per_token"] == 2*40*40*128*2                      # 800 KiB per token

def test_max_concurrency_grows_with_utilization():
    c = [A100(gpu_memory_utilization=u).memory["max_concurrency"] for u in (0.8, 0.9, 0.95)]
    assert c[0] < c[1] < c[2] and 4 < c[0] < 5 and 6.5 < c[1] < 7.5 and 7.5 < c[2] < 9

def test_contiguous_waste_against_paged():
    w = A100().waste(S.seed_workload(60))
    assert 0.6 <= w["contiguous"] <= 0.8 and w["paged"] < 0.04

def test_start_up_line_matches_the_engine(tmp_path, monkeypatch):
    from pagednb import LLM
    from helpers import tiny_hf_model
    tiny_hf_model("llama", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory_bytes=1 << 20, max_model_len=128, log=False)
    monkeypatch.setitem(S.COST_MODELS, "cpu", S.CostModel(1e11, 1e10))      # as if calibrated
    sim = S.Simulator(str(tmp_path), "cpu", log=False, **S.engine_knob_values(llm))
    assert sim.kv_line == llm.engine.kv_line and sim.num_blocks == llm.engine.block_manager.num_blocks

def test_model_that_does_not_fit_gets_the_engines_error():
    with pytest.raises(ValueError, match=r"weights \(24.24 GiB\)"):
        S.Simulator("Llama-2-13B", "T4", log=False)

def test_unknown_gpu_and_model_list_the_known_ones():
    with pytest.raises(ValueError, match="H100-80GB"): S.Simulator("Llama-2-13B", "H300")
    with pytest.raises(ValueError, match="Mistral-7B"): S.Simulator("Llama-5", "H200")
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        S.Simulator("Llama-2-13B", gpu_mem_util=0.9)

def test_bad_workload_fields_are_named():
    with pytest.raises(ValueError, match="rate"): S.poisson(-1, 10)
    with pytest.raises(ValueError, match="prompt_len"): S.offline(3, 0, 10)
    with pytest.raises(ValueError, match="max_model_len=2048"): A100().run(S.offline(2, 2000, 100))

def test_config_json_path(tmp_path):
    (tmp_path/"config.json").write_text(json.dumps(S.MODELS["Llama-3-8B"]))
    assert S.Simulator(str(tmp_path), "H100-80GB", log=False).memory["kv_bytes_per_token"] == 2*32*8*128*2

def test_run_uses_the_real_scheduler_and_records_a_trace():
    r = A100().run(S.shared_prompt(8, 64, 16, (4, 8), rate=10), trace=True)
    assert isinstance(r.trace, Trace) and r.trace.meta["simulated"]
    assert len(r.trace) == r.metrics["num_steps"]
    times = [s["time"] for s in r.trace.steps]
    assert times == sorted(times) and r.metrics["prefix_cache_hit_rate"] > 0
    want = sum(q.output_len for q in S.shared_prompt(8, 64, 16, (4, 8)).requests)
    assert r.metrics["generation_tokens"] == want
    Trace.from_dict(json.loads(r.trace.to_json()))                      # serialisable, as the widgets read it

def test_prefix_caching_cuts_ttft_and_closed_loop_keeps_concurrency():
    w = S.shared_prompt(24, 1024, 32, 32, rate=8)
    on, off = A100().run(w).metrics, A100(enable_prefix_caching=False).run(w).metrics
    assert on["ttft_p50"] < off["ttft_p50"]
    r = A100().run(S.concurrent(4, 12, 100, 20))
    assert max(len([1 for q in r.requests if q["arrival_time"] <= t < q["finished_time"]])
               for t in [q["arrival_time"] for q in r.requests]) <= 4

def test_speculation_emits_more_than_one_token_per_step():
    spec = dict(method="ngram", num_speculative_tokens=4, acceptance_rate=0.8)
    m = A100(speculative_config=spec).run(S.concurrent(1, 2, 100, 64)).metrics
    assert m["spec_mean_accepted_length"] > 2 and m["num_steps"] < 2*64
    with pytest.raises(ValueError, match="acceptance_rate"):
        A100(speculative_config=dict(method="ngram")).run(S.offline(1, 10, 4))

def test_sweep_and_fit_recover_a_known_cost():
    rows = A100().sweep("gpu_memory_utilization", [0.8, 0.95], S.seed_workload(20))
    assert rows[0]["max_concurrency"] < rows[1]["max_concurrency"]
    fake = S.CostModel(2e11, 3e10, 1, 0.5, 1, 0.01, 5e-4)
    sh = S.model_shape(S.model_config("SmolLM2-135M"), 4)
    shapes = [[(1, c)]*b for b in (1, 8, 32) for c in (16, 900)]
    shapes += [[(p, 0)]*b for p in (128, 512) for b in (1, 8)]
    samples = [(f, fake.step_time(f)) for f in (S.step_features(sh, bt, len(bt)) for bt in shapes)]
    assert abs(S.relative_errors(S.cost_from_fit(S.fit_cost(samples)), samples)).max() < 1e-3

def test_hub_id_fetches_config_json_only(monkeypatch, tmp_path):
    (tmp_path/"config.json").write_text(json.dumps(S.MODELS["Mistral-7B"]))
    asked = []
    monkeypatch.setattr(S, "_hub_config", lambda r: asked.append(r) or str(tmp_path/"config.json"))
    assert S.model_config("mistralai/Mistral-7B-v0.1").num_key_value_heads == 8
    assert asked == ["mistralai/Mistral-7B-v0.1"]

def test_prints_the_engine_start_up_line(capsys):
    S.Simulator("Llama-3-8B", "H100-80GB", max_model_len=4096)
    out = capsys.readouterr().out
    assert "KV cache: " in out and " blocks × 16 tokens = " in out
    assert "max concurrency at max_model_len: " in out
    assert "bfloat16" in out
    assert S.Simulator("SmolLM2-135M", "T4", max_model_len=1024, log=False).dtype == "float16"


# --- hybrid models: sized by their KV-cache groups, stepped through the grouped block manager ---

from pagednb.hybrid_kv import max_concurrency, model_kv_groups

@pytest.mark.parametrize("model,kinds", [("Mistral-7B-v0.1", {4096: 1}), ("gemma-2-9b", {4096: 1, None: 1}),
                                         ("gemma-3-12b", {1024: 5, None: 1}), ("gemma-3-27b", {1024: 6, None: 1})])
def test_hybrid_models_are_sized_by_their_groups(model, kinds):
    s = S.Simulator(model, "A100-80GB", max_model_len=8192, log=False)
    got = {}
    for g in s.kv_groups: got[g.window] = got.get(g.window, 0) + 1
    assert got == kinds and "KV-cache group" in s.kv_line
    c = s.sched_config
    want = max_concurrency(s.kv_groups, s.num_blocks, 16, c.max_model_len, c.max_num_batched_tokens, null_block=0)
    assert s.memory["max_concurrency"] == want
    assert s.block_bytes == s.shape["kv_bytes_per_token"]//s.config.num_hidden_layers*len(s.kv_groups[0].layers)*16

def test_a_window_raises_concurrency_for_the_same_bytes():
    full = S.Simulator("Mistral-7B", "A100-80GB", max_model_len=32768, log=False)
    windowed = S.Simulator("Mistral-7B-v0.1", "A100-80GB", max_model_len=32768, log=False)
    assert full.num_blocks == windowed.num_blocks                      # one group of every layer: the same blocks
    assert windowed.memory["max_concurrency"] > 4*full.memory["max_concurrency"]

def test_qwen2_windows_through_hf_overrides():
    o = dict(use_sliding_window=True, sliding_window=4096, max_window_layers=14)
    s = S.Simulator("Qwen2.5-7B", "A100-80GB", max_model_len=32768, log=False, hf_overrides=o)
    assert [g.window for g in s.kv_groups] == [None, 4096]
    assert s.memory["max_concurrency"] > S.Simulator("Qwen2.5-7B", "A100-80GB", max_model_len=32768,
                                                     log=False).memory["max_concurrency"]

def test_windows_free_blocks_in_the_simulated_run():
    "Long outputs on a pool one full-attention request would fill: the windowed model never preempts."
    kw = dict(max_model_len=16384, num_gpu_blocks_override=2400, log=False)       # 38,400 tokens
    wl = S.offline(8, 512, 6000)                                                   # 52,096 tokens in all
    full = S.Simulator("Mistral-7B", "A100-80GB", **kw).run(wl)
    windowed = S.Simulator("Mistral-7B-v0.1", "A100-80GB", **kw).run(wl)
    assert full.metrics["num_preemptions"] > 0 and windowed.metrics["num_preemptions"] == 0
    assert windowed.metrics["generation_tokens"] == full.metrics["generation_tokens"] == 8*6000

# --- more than one GPU, more GPUs, quantized weights, the vllm serve line ----------------------------------------

def L3(device="H100-80GB", **kw): return S.Simulator("Llama-3-8B", device, max_model_len=8192, log=False, **kw)

@pytest.mark.parametrize("tp,kv_heads", [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1)])
def test_tp_splits_llama3_kv_heads_and_replicates_past_eight(tp, kv_heads):
    shard = S.shard_config(S.model_config("Llama-3-8B"), tp)
    assert (shard.num_key_value_heads, shard.num_attention_heads, shard.head_dim) == (kv_heads, 32//tp, 128)
    assert L3(tensor_parallel_size=tp).memory["kv_bytes_per_token"] == 2*32*kv_heads*128*2   # K and V, bf16

def test_tp_weights_split_and_kv_budget_by_hand():
    one, two = L3().memory, L3(tensor_parallel_size=2).memory
    emb = 128256*4096*2                                                  # embedding and untied LM head, bf16
    layer = 2*4096*4096 + 2*4096*1024 + 3*4096*14336 + 2*4096            # q, o; k, v; the MLP; two norms
    assert one["weights"] == (32*layer + 4096)*2 + 2*emb
    per_gpu_layer = 2*4096*2048 + 2*4096*512 + 3*4096*7168 + 2*4096
    assert two["weights"] == (32*per_gpu_layer + 4096)*2 + 2*emb//2
    assert two["kv_tokens"] > 2*one["kv_tokens"] and two["num_gpus"] == 2
    assert two["kv_bytes_total"] == 2*two["kv_bytes"]

def test_tp_that_does_not_divide_the_heads_gets_vllms_error():
    with pytest.raises(ValueError, match=r"Total number of attention heads \(32\) must be divisible by tensor "
                                         r"parallel size \(3\)\."):
        L3(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 is invalid"): L3(tensor_parallel_size=0)

def test_pp_splits_the_layers():
    pp2 = L3(pipeline_parallel_size=2).memory
    assert pp2["kv_bytes_per_token"] == 2*16*8*128*2                     # 16 layers a stage
    assert S.shard_config(S.model_config("Llama-3-8B"), 1, 3).num_hidden_layers == 11
    with pytest.raises(ValueError, match="pipeline_parallel_size=33 is more than the model's 32 layers"):
        L3(pipeline_parallel_size=33)

def test_tp_adds_all_reduces_to_the_step():
    sim = L3(tensor_parallel_size=2)
    f = S.step_features(sim.shape, [(1, 100)]*4, 4)
    assert f["allreduces"] == 64 and f["allreduce_bytes"] == 4*2*32*4096*2      # ring 2(tp-1)/tp = 1
    assert S.step_features(L3().shape, [(1, 100)], 1)["allreduces"] == 0
    assert sim.cost.interconnect == 450e9

NEW_GPUS = ["RTX-3090", "RTX-4090", "L40S", "H100-PCIe", "H100-NVL", "B200", "MI300X"]

@pytest.mark.parametrize("name", NEW_GPUS)
def test_each_new_gpu_is_there_with_sane_fields(name):
    g = S.GPUS[name]
    assert g.name == name and 0.9*g.nominal_gb*1e9 < g.memory <= g.nominal_gb*S.GiB
    assert 0.5e12 < g.bandwidth < 10e12 and 50e12 < g.fp16 < 3e15 and g.bf16 == g.fp16
    assert g.interconnect >= 32e9 and g.link
    assert L3(name).memory["kv_tokens"] > 0

def test_unknown_gpu_names_the_new_ones():
    with pytest.raises(ValueError, match="MI300X"): L3("MI400")

def test_quantization_bytes_per_weight():
    assert S.QUANT_BYTES["fp8"] == S.QUANT_BYTES["int8"] == 1.0
    assert S.QUANT_BYTES["awq"] == S.QUANT_BYTES["gptq"] == 0.5 + 2.5/128 and S.QUANT_BYTES["mxfp4"] == 0.53125
    cfg = S.model_config("Llama-3-8B")
    emb = 2*128256*4096*2 + 4096*2                                       # stays in bf16
    assert S.gpu_weight_bytes(cfg, 2, "fp8") == 32*S.layer_params(cfg) + emb
    assert L3(quantization="awq").memory["weights"] < 0.5*L3().memory["weights"]
    assert L3(quantization="fp8").shape["weights"] == L3(quantization="fp8").weight_bytes
    with pytest.raises(ValueError, match=r"quantization='nf4' is not one the simulator models; use one of"):
        L3(quantization="nf4")

def test_vllm_command_exact_text():
    assert L3("H100-80GB", tensor_parallel_size=2).vllm_command() == \
        "vllm serve meta-llama/Meta-Llama-3-8B --tensor-parallel-size 2 --max-model-len 8192"
    sim = S.Simulator("Llama-2-13B", "A100-40GB", max_model_len=2048, gpu_memory_utilization=0.95,
                      pipeline_parallel_size=2, enable_prefix_caching=False, enforce_eager=True, max_num_seqs=64,
                      speculative_config=dict(method="ngram", num_speculative_tokens=3, acceptance_rate=0.5),
                      log=False)
    assert sim.vllm_command() == (
        "vllm serve meta-llama/Llama-2-13b-hf --pipeline-parallel-size 2 --gpu-memory-utilization 0.95 "
        "--max-model-len 2048 --max-num-seqs 64 --no-enable-prefix-caching --enforce-eager "
        """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'""")

def test_vllm_only_knobs_the_simulator_does_not_model_still_fail():
    with pytest.raises(NotImplementedError, match="data_parallel_size"): L3(data_parallel_size=2)

def test_kv_cache_dtype_sizes_the_pool_and_reads_fewer_bytes():
    bf16, fp8 = L3(), L3(kv_cache_dtype="fp8")
    assert bf16.memory["kv_bytes_per_token"] == 32*8*128*2*2 == 2*fp8.memory["kv_bytes_per_token"]
    assert fp8.memory["kv_bytes"] == bf16.memory["kv_bytes"] or abs(fp8.memory["kv_bytes"] - bf16.memory["kv_bytes"]) \
        < fp8.block_bytes                                    # the same bytes, in blocks half the size
    assert fp8.memory["num_blocks"] in (2*bf16.memory["num_blocks"], 2*bf16.memory["num_blocks"] + 1)
    assert L3(kv_cache_dtype="bfloat16").memory == bf16.memory        # the model's own dtype: nothing changes
    # the cost model reads half the KV bytes: one decode step over 64 sequences of 4,000 tokens is cheaper
    batch = [(1, 4000)]*64
    t = [S.step_features(x.shape, batch, 64)["bytes"] for x in (bf16, fp8)]
    assert t[1] < t[0]

def test_cuda_graph_memory_comes_off_the_kv_budget_unless_enforce_eager():
    sizes = S.vllm_capture_sizes()
    assert len(sizes) == 51 and sizes[-1] == 512 and S.vllm_capture_sizes(64)[-1] == 128
    plain, graphs = L3(), L3(cudagraph_capture_sizes=sizes)
    eager = L3(cudagraph_capture_sizes=sizes, enforce_eager=True)
    est = S.cuda_graph_bytes(graphs.shard, sizes, 2)
    assert graphs.memory["cuda_graphs"] == est and abs(est/S.GiB - 0.46) < 0.01
    assert plain.memory["cuda_graphs"] == eager.memory["cuda_graphs"] == 0
    assert eager.num_blocks == plain.num_blocks
    assert plain.num_blocks - graphs.num_blocks in (est//graphs.block_bytes, est//graphs.block_bytes + 1)
    assert eager.vllm_command().endswith("--enforce-eager")

def test_what_ifs_size_a_vllm_logs_configuration_and_change_one_knob():
    from pathlib import Path
    from pagednb.vllm_read import explain_vllm_log
    log = Path(__file__).parent/"fixtures"/"vllm_logs"/"v0_llama-3.1-8b_rtx3090_20k.log"
    info = explain_vllm_log(log.read_text())
    assert S.log_knobs(info) == dict(gpu_memory_utilization=0.9, max_model_len=20000)
    llama31 = S.MODELS["Llama-3-8B"] | dict(max_position_embeddings=131072)
    rows = S.what_ifs(info, llama31, "RTX-3090", enable_chunked_prefill=False)
    assert [r["what"] for r in rows][:2] == ["as the log", "gpu_memory_utilization=0.95"]
    assert abs(rows[0]["kv_gib"]/info["available_kv_cache_gib"] - 1) < 0.05          # the log: 3.81 GiB
    assert rows[3]["what"] == "tensor_parallel_size=2" and rows[3]["kv_tokens"] > 2*rows[0]["kv_tokens"]
    bad = S.what_ifs(info, llama31, "RTX-3090", {"TP 3": dict(tensor_parallel_size=3)})
    assert "must be divisible by tensor parallel size (3)" in bad[0]["error"]
    assert "TP 3" in S.format_what_ifs(bad)

def test_fidelity_predicts_published_logs_kv_cache_and_says_what_it_skips():
    from pathlib import Path
    from pagednb.vllm_read import read_fixtures
    rows = {r["log"]: r for r in S.fidelity(read_fixtures(Path(__file__).parent/"fixtures"/"vllm_logs"))}
    sized = [r for r in rows.values() if "skipped" not in r]
    v1 = [r for r in sized if r["engine"] == "V1"]
    assert v1 and all(r["error_pct"] is not None and abs(r["error_pct"]) <= 5 for r in v1
                      if r["log"] != "v1_qwen3-235b-a22b-fp8_4xh100_tp4")
    q = rows["v1_qwen3-0.6b_a100_flashinfer_bf16"]                           # the log: 69.66 GiB, 652,144 tokens
    assert q["reported_tokens"] == 652144 and abs(q["predicted_tokens"]/652144 - 1) < 0.01 and q["tp"] == 1
    assert abs(rows["v0_llama-3.1-8b_rtx3090_20k"]["error_pct"]) < 5              # 31,232 tokens (1,952 blocks)
    assert abs(rows["v0_llama-3-8b_h100_tp1_table"]["error_pct"]) < 5             # 53.29 GiB
    assert all(r["note"] for r in sized if r["error_pct"] is None or abs(r["error_pct"]) > 1)   # each miss says why
    assert "does not name its model" in rows["v1_fp8kv_len100k"]["skipped"]
    assert "does not name its GPU" in rows["v1_qwen3-32b_tp2_journald"]["skipped"]
    moe = rows["v1_qwen3-235b-a22b-fp8_4xh100_tp4"]                           # MoE: sized now, its miss explained
    assert "skipped" not in moe and moe["reported_tokens"] == 178880 and "experts" in moe["note"]
    assert moe["predicted_tokens"] > moe["reported_tokens"]            # the simulator leaves memory out, never adds
    assert "not closed" in moe["note"] and "fused-MoE scratch" in moe["note"]   # why it stays outside the 5%
    assert "not in the simulator's table" in rows["v1_deepseek-v4-flash_2xgh200_tp2_too_long"]["skipped"]
    assert "not sized:" in S.format_fidelity(list(rows.values()))


# --- mixtures of experts and MLA (DeepSeek): counted from their configs

def _tiny_moe_configs():
    "Tiny transformers configs of each MoE family: dense layers, shared experts, MLA with and without a q rank."
    tf = pytest.importorskip("transformers")
    base = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, intermediate_size=48)
    mla = dict(base, num_key_value_heads=4, moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2,
               first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
               n_group=1, topk_group=1)
    return {"mixtral": tf.MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2),
            "qwen2_moe": tf.Qwen2MoeConfig(**base, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                           num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                           decoder_sparse_step=1),
            "qwen3_moe": tf.Qwen3MoeConfig(**base, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                           head_dim=16),
            "qwen3_moe_sparse": tf.Qwen3MoeConfig(**base, moe_intermediate_size=24, num_experts=4,
                                                  num_experts_per_tok=2, head_dim=16, decoder_sparse_step=2,
                                                  mlp_only_layers=[3], tie_word_embeddings=True),   # 0, 2, 3 dense
            "deepseek_v3": tf.DeepseekV3Config(**mla, n_shared_experts=1, q_lora_rank=24),
            "deepseek_v2": tf.DeepseekV2Config(**mla, n_shared_experts=2, q_lora_rank=None)}

@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_sparse", "deepseek_v3",
                                    "deepseek_v2"])
def test_moe_parameter_count_is_the_real_models(family):
    "Every expert counted: the simulator's count of a tiny random model equals the model's own."
    import torch
    from transformers import AutoModelForCausalLM
    hf = _tiny_moe_configs()[family]
    torch.manual_seed(0)
    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    cfg = S.model_config(hf.to_dict())
    assert type(cfg).__name__ == "SimConfig" and cfg.num_experts > 0
    assert S.num_params(cfg) == real
    assert S.num_params(cfg, active=True) < real               # a token runs through 2 experts of 4 or 6

def test_moe_activations_are_vllms_fused_moe_scratch_and_the_sampler_sees_the_whole_vocabulary():
    "vLLM's fused_experts: cache13 of M x top_k x max(N, K) and cache2 of M x top_k x N/2 (N: gate/up, K: hidden)."
    shard = S.shard_config(S.model_config("Qwen3-235B-A22B"), tp=4)
    assert S.mlp_activations(shard, 8192) == 8192*8*(max(2*384, 4096) + 384)
    h100, a100 = S.GPUS["H100-80GB"], S.GPUS["A100-80GB"]           # an A100 has vLLM's smaller defaults
    assert S.vllm_max_num_seqs("V1", h100) == 1024 and S.vllm_token_budget("V1", 4096, a100, server=False)[0] == 8192
    sim = S.Simulator("Qwen3-235B-A22B", "H100-80GB", tensor_parallel_size=4, quantization="fp8", max_num_seqs=1024,
                      max_num_batched_tokens=8192, log=False)
    logits = 1024*151936*(2 + 4)                                   # every TP rank gathers the whole vocabulary
    assert sim.memory["activations"] == 8192*(4*4096 + 18*128)*2 + S.mlp_activations(sim.shard, 8192)*2 + logits

def test_moe_counts_by_hand():
    mx = S.model_config("Mixtral-8x7B")
    attn, expert = 2*4096*4096 + 2*4096*1024, 3*4096*14336
    assert S.layer_params(mx) == attn + 4096*8 + 8*expert + 2*4096                     # router, 8 experts, norms
    assert S.layer_params(mx, active=True) == attn + 4096*8 + 2*expert + 2*4096
    assert S.num_params(mx) == 32*S.layer_params(mx) + 4096 + 2*32000*4096            # 46.7B
    ds = S.model_config("DeepSeek-V3")
    mla = 7168*1536 + 1536 + 1536*128*192 + 7168*576 + 512 + 512*128*256 + 128*128*7168
    assert S.attention_params(ds) == mla
    assert S.mlp_params(ds, 0) == 3*7168*18432                                        # the 3 dense layers
    assert S.mlp_params(ds, 3) == 7168*256 + 3*7168*2048*(256 + 1)                    # 256 routed + 1 shared
    assert S.mlp_params(ds, 3, active=True) == 7168*256 + 3*7168*2048*(8 + 1)
    assert round(S.num_params(ds)/1e9) == 671 and round(S.num_params(ds, active=True)/1e9) == 38

def test_mla_caches_one_latent_per_token_and_layer_on_every_gpu():
    latent = 61*(512 + 64)                                         # kv_lora_rank + qk_rope_head_dim, one "head"
    sims = {tp: S.Simulator("DeepSeek-V3", "B200", tensor_parallel_size=tp, quantization="fp8", log=False)
            for tp in (8, 16)}
    for s in sims.values():                                        # not split by TP, as K/V heads are
        assert s.memory["kv_bytes_per_token"] == latent*2 == S.kv_bytes_per_token(S.model_config("DeepSeek-V3"), 2)
    sim = sims[8]
    fp8 = S.Simulator("DeepSeek-V3", "B200", tensor_parallel_size=8, quantization="fp8", kv_cache_dtype="fp8",
                      log=False)
    assert fp8.memory["kv_bytes_per_token"] == latent and fp8.memory["kv_tokens"] > 1.9*sim.memory["kv_tokens"]
    assert abs(sim.memory["weights"]/S.GiB - 671e9/8/S.GiB) < 4           # fp8 experts on each of 8 GPUs
    assert S.Simulator("DeepSeek-V3", "B200", tensor_parallel_size=8, pipeline_parallel_size=2, quantization="fp8",
                       log=False).memory["kv_bytes_per_token"] == 31*576*2          # the first stage's 31 layers
    with pytest.raises(ValueError, match=r"attention heads \(128\) must be divisible by tensor parallel size \(3\)"):
        S.Simulator("DeepSeek-V3", "B200", tensor_parallel_size=3, log=False)

def test_moe_tp_splits_each_expert_and_the_cost_model_reads_the_chosen_experts():
    two, four = (S.Simulator("Mixtral-8x7B", "H100-80GB", tensor_parallel_size=tp, log=False) for tp in (2, 4))
    assert abs(four.weight_bytes/two.weight_bytes - 0.5) < 0.01 and four.shard.moe_intermediate_size == 14336//4
    assert two.shape["body"] == S.body_params(two.shard, active=True) < 0.3*S.body_params(two.shard)
    read = [S.step_features(two.shape, [(1, 100)]*n, n)["bytes"] - n*101*two.shape["kv_bytes_per_token"]
            for n in (1, 4, 64)]
    assert read[0] < read[1] < read[2] and abs(read[2]/two.shape["weights"] - 1) < 1e-3
    assert abs(read[0]/two.shape["weights"] - 0.27) < 0.01              # one token reads 2 of 8 experts
    dense = S.Simulator("Llama-3-8B", "H100-80GB", log=False)
    assert S.step_features(dense.shape, [(1, 100)], 1)["bytes"] == dense.shape["weights"] + 101*131072

def test_tp_takes_nccl_memory_off_each_gpus_kv_budget():
    one, four = L3(), L3(tensor_parallel_size=4)
    assert one.memory["non_torch"] == 0 and four.memory["non_torch"] == 3*S.NCCL_PER_PEER      # 0.23 GiB at TP 4
    assert four.num_blocks == (S.gpu_kv_budget(four.gpu_memory, 0.9) - four.non_torch)//four.block_bytes
    assert "NCCL 0.23 GiB" in four.memory_line and "NCCL" not in one.memory_line
    assert L3(pipeline_parallel_size=2).memory["non_torch"] == S.NCCL_PER_PEER

def test_prediction_at_the_speed_timed_beside_the_run(monkeypatch):
    "A machine 25% slower than calibrated: the probes say so, and the prediction made at that speed holds."
    sim, wl = S.Simulator("Llama-3-8B", "H100-80GB", log=False), S.offline(8, 200, 40)
    f = S.step_features(sim.shape, [(1, 100)]*8, 8)
    assert abs(sim.at_speed(1.25).cost.step_time(f)/sim.cost.step_time(f) - 1.25) < 1e-12
    measured = sim.at_speed(1.25).run(wl).metrics                     # what the slowed machine would measure
    monkeypatch.setattr(S, "measure", lambda llm, w: measured)
    probes = iter([1.2, 1.3])                                          # the probe before and after the run
    monkeypatch.setattr(S.Simulator, "speed", lambda self, llm, probe=S.PROBE: next(probes))
    held = S.predicted_vs_measured(sim, None, [wl], drift=True)[0]
    plain = S.predicted_vs_measured(sim, None, [wl])[0]
    assert abs(plain["output_throughput_error"]) > 0.15                # the calibration alone misses
    assert abs(held["output_throughput_error"]) < 0.01 and held["speed"] == 1.25
    assert abs(held["band"] - 0.1/2.5) < 1e-12                         # half the probes' change: 4%
    assert "speed" in S.format_validation([held]) and "speed" not in S.format_validation([plain])

def test_scheduling_policy_reaches_the_simulator():
    "`scheduling_policy='shortest'` predicts earlier median first tokens than `fcfs` on a burst of mixed prompts."
    burst = S.Workload([S.SimRequest(n, 4, 0.0) for n in (1200, 900, 60, 700, 40, 1000, 80, 50)])
    p50 = {p: A100(scheduling_policy=p, max_num_batched_tokens=256).run(burst).metrics["ttft_p50"]
           for p in ("fcfs", "shortest")}
    assert p50["shortest"] < 0.7 * p50["fcfs"]
