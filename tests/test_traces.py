"""Real traffic for the simulator (`09a_capacity`): Mooncake traces read into workloads, the prefix-cache ceiling,
multi-turn chat sessions, and the second KV tier of the simulated engine."""
import gzip, json
import pytest
from pagednb import sim as S

RECORDS = [dict(timestamp=1000, input_length=1100, output_length=5, hash_ids=[0, 1, 2]),   # 512 + 512 + a last 76
           dict(timestamp=1500, input_length=1024, output_length=3, hash_ids=[0, 1]),      # its first two blocks
           dict(timestamp=2000, input_length=700, output_length=4, hash_ids=[0, 3]),       # its first block
           dict(timestamp=2600, input_length=300, output_length=2, hash_ids=[]),           # nothing shared
           dict(timestamp=3000, input_length=600, output_length=2, hash_ids=[0, 1])]       # block 1 cut at 88

def write(path, records, extra=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(extra))
    return path

@pytest.fixture
def trace(tmp_path): return write(tmp_path/"trace.jsonl", RECORDS)

def test_reader_shares_exactly_what_the_ids_say(trace):
    w = S.load_trace(trace)
    p = [r.prompt for r in w.requests]
    assert [len(x) for x in p] == [1100, 1024, 700, 300, 600]
    assert [r.output_len for r in w.requests] == [5, 3, 4, 2, 2]
    assert [r.arrival_time for r in w.requests] == [0.0, 0.5, 1.0, 1.6, 2.0]
    assert p[1] == p[0][:1024] and p[4] == p[0][:600]                 # a partial last block: its id's first tokens
    assert p[2][:512] == p[0][:512] and p[2][512] != p[0][512]
    assert not set(map(tuple, [p[3][i:i + 16] for i in range(0, 288, 16)])) & {tuple(p[0][i:i + 16]) for i in range(0, 1088, 16)}
    assert all(isinstance(x, list) and all(100 <= t < 1100 for t in x) for x in p)
    assert S.load_trace(trace).requests[2].prompt == p[2]              # deterministic

def test_reader_gzip_blank_lines_and_lazy_prompts(trace, tmp_path):
    gz = tmp_path/"trace.jsonl.gz"
    gz.write_bytes(gzip.compress(trace.read_bytes() + b"\n\n"))
    eager, lazy = S.load_trace(gz), S.load_trace(trace, token_ids=False)
    assert [r.prompt for r in eager.requests] == [r.prompt for r in S.load_trace(trace).requests]
    assert [S.prompt_tokens(r, i) for i, r in enumerate(lazy.requests)] == [r.prompt for r in eager.requests]

def test_scales_sampling_and_granularity(trace):
    w = S.load_trace(trace, length_scale=1/32)                         # a 512-token block becomes 16 tokens
    assert [r.prompt_len for r in w.requests] == [34, 32, 22, 9, 19]
    assert w.requests[1].prompt == w.requests[0].prompt[:32] and w.requests[4].prompt == w.requests[0].prompt[:19]
    assert [r.output_len for r in w.requests] == [1]*5                  # outputs scale too, never below 1
    assert [r.arrival_time for r in S.load_trace(trace, time_scale=2).requests] == [0.0, 1.0, 2.0, 3.2, 4.0]
    assert len(S.load_trace(trace, sample=0.4)) == 2 and len(S.load_trace(trace, sample=3, max_requests=2)) == 2
    assert S.load_trace(trace, sample=3, seed=4).requests[0].prompt == S.load_trace(trace, sample=3, seed=4).requests[0].prompt
    w16 = S.load_trace(trace, block_size=16)                            # a trace of 16-token blocks: an id per 16
    assert w16.requests[1].prompt[:32] == w16.requests[0].prompt[:32] != w16.requests[1].prompt[:33]
    with pytest.raises(ValueError, match="line 1: hash_ids"): S.load_trace(write(trace, [dict(RECORDS[2], input_length=10)]))

@pytest.mark.parametrize("line, match", [
    ('{"timestamp": 0, "output_length": 2, "hash_ids": []}', "line 3: input_length missing"),
    ('{"timestamp": -5, "input_length": 10, "output_length": 2}', "line 3: timestamp=-5 is invalid"),
    ('{"timestamp": NaN, "input_length": 10, "output_length": 2}', "line 3: timestamp=nan is invalid"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2', "line 3: not JSON"),
    ('[1, 2]', "line 3: timestamp, input_length, output_length missing"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 2}', "line 3: input_length=0 is invalid"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2.5}', "line 3: output_length=2.5 is invalid"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, -2]}', "line 3: hash_ids"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]}', "line 3: hash_ids")])
def test_malformed_line_is_named_and_nothing_is_loaded(tmp_path, line, match):
    path = write(tmp_path/"bad.jsonl", RECORDS[:2], [line + "\n"] + [json.dumps(r) + "\n" for r in RECORDS[2:]])
    with pytest.raises(ValueError, match=match): S.load_trace(path)     # raises: no workload, half or whole

def test_bad_options_and_an_empty_trace(trace, tmp_path):
    for kw, match in [(dict(sample=0), "sample=0"), (dict(sample=1.5), "sample=1.5"), (dict(max_requests=0), "max_requests"),
                      (dict(length_scale=0), "length_scale"), (dict(time_scale=-1), "time_scale"), (dict(block_size=0), "block_size")]:
        with pytest.raises(ValueError, match=match): S.load_trace(trace, **kw)
    with pytest.raises(ValueError, match="no requests"): S.load_trace(write(tmp_path/"empty.jsonl", [], ["\n"]))

def test_ceiling_against_a_hand_count(trace):
    w = S.load_trace(trace)
    # 512-token blocks before each prompt's last token, seen before: 0, 1 (of 1023 tokens), 1, 0, 1 (of 599)
    assert w.prefix_hit_ceiling(512) == 3*512/(1100 + 1024 + 700 + 300 + 600)
    # 16-token blocks: 0, 63 (1023//16), 32, 0, 37 (599//16: all in request 0's prompt)
    assert w.prefix_hit_ceiling(16) == (63 + 32 + 37)*16/3724
    assert S.load_trace(trace, token_ids=False).prefix_hit_ceiling(512) == w.prefix_hit_ceiling(512)
    assert S.offline(5, 40, 4).prefix_hit_ceiling() == 0.0
    assert S.shared_prompt(4, 64, 16, 4).prefix_hit_ceiling() == 3*64/(4*80)

def test_shipped_trace_and_its_ceiling():
    p = S.mooncake_trace_path()
    assert (p.parent/"LICENSE-APACHE").is_file() and "Apache" in (p.parent/"README.md").read_text()
    w = S.load_trace(p, token_ids=False)
    assert len(w) == 12031 and round(sum(r.prompt_len for r in w.requests)/len(w)) == 12035
    assert 0.37 < w.prefix_hit_ceiling(512) < 0.38                     # a third, far from 75-95%

def test_chat_sessions_share_their_history():
    w = S.chat_sessions(4, turns=(2, 4), system_len=64, user_len=(8, 40), output_len=(8, 40), think_time=(1.0, 3.0))
    by_start = {}
    for r in sorted(w.requests, key=lambda r: r.arrival_time):
        by_start.setdefault(tuple(r.prompt[:72]), []).append(r)            # a chat: the system prompt and message 1
    assert len(by_start) == 4 and all(2 <= len(v) <= 4 for v in by_start.values())
    for turns in by_start.values():
        for a, b in zip(turns, turns[1:]):
            assert b.prompt[:len(a.prompt)] == a.prompt and len(b.prompt) > len(a.prompt) + a.output_len
            assert 1.0 <= b.arrival_time - a.arrival_time <= 3.0
    assert all(r.prompt[:64] == w.requests[0].prompt[:64] for r in w.requests)
    assert S.chat_sessions(4, seed=3).requests[5].prompt == S.chat_sessions(4, seed=3).requests[5].prompt
    assert w.prefix_hit_ceiling() > 0.5
    with pytest.raises(ValueError, match="rate=0"): S.chat_sessions(2, rate=0)

# --- the second KV tier of the simulated engine

def L31(**kw):
    "Llama-3.1-8B on an H100 with a pool of 600 blocks (9,600 tokens): small enough to forget a chat."
    return S.Simulator("Llama-3.1-8B", "H100-80GB", max_model_len=8192, num_gpu_blocks_override=600, log=False, **kw)

CHATS = S.chat_sessions(16, turns=(3, 5), system_len=512, user_len=(64, 512), output_len=(8, 32),
                        think_time=(4.0, 12.0), rate=1.0, seed=2)

def test_no_tier_is_todays_simulator_exactly():
    base = L31().run(CHATS, snapshot=False).metrics
    for size in (None, 0):
        m = L31(kv_offloading_size=size).run(CHATS, snapshot=False).metrics
        assert m == base and "tier_hit_rate" not in m

def test_more_tier_never_hits_less_and_stays_in_its_capacity():
    rows = L31().sweep("kv_offloading_size", [0, 0.25, 1, 4, 64], CHATS)
    both = [r["prefix_cache_hit_rate"] for r in rows]
    assert both == sorted(both) and both[-1] > both[0] + 0.1, both
    for r in rows[1:]:
        assert r["pool_hit_rate"] + r["tier_hit_rate"] == pytest.approx(r["prefix_cache_hit_rate"])
        assert 0 < r["tier_usage_peak"] <= 1.0 and r["tier_blocks_loaded"] > 0
    assert rows[-1]["ttft_p50"] < rows[0]["ttft_p50"]                       # loads beat recomputing here
    assert both[-1] <= CHATS.prefix_hit_ceiling() + 1e-9

def test_load_time_slow_links_and_no_overlap_cost_more():
    m = {k: L31(kv_offloading_size=4, **kw).run(CHATS, snapshot=False).metrics for k, kw in [
        ("pcie5", {}), ("nvme", dict(kv_offloading_link="NVMe")), ("serial", dict(kv_offloading_overlap=False))]}
    assert m["pcie5"]["tier_load_time"] < m["nvme"]["tier_load_time"]
    assert m["pcie5"]["ttft_p99"] <= m["serial"]["ttft_p99"] and m["pcie5"]["ttft_p99"] <= m["nvme"]["ttft_p99"]
    assert m["pcie5"]["tier_hit_rate"] > 0

def test_tier_knobs_are_checked():
    for kw, match in [(dict(kv_offloading_size=-1), "kv_offloading_size=-1"), (dict(kv_offloading_size=float("nan")), "nan"),
                      (dict(kv_offloading_backend="lmcache"), "'native' only"), (dict(kv_offloading_link="SATA"), "NVMe"),
                      (dict(kv_offloading_size=4, enable_prefix_caching=False), "enable_prefix_caching")]:
        with pytest.raises(ValueError, match=match): L31(**kw)
    with pytest.raises(ValueError, match="one KV-cache group"):
        S.Simulator("gemma-3-12b", "H100-80GB", max_model_len=8192, kv_offloading_size=4, log=False)
    assert L31(kv_offloading_size=1).tier_blocks == 512                     # 2 MiB blocks: 16 tokens of 128 KiB

def test_tiered_pool_random_lookups_keep_its_books():
    import random
    from pagednb.block_manager import Sequence
    rng, bm = random.Random(0), S.TieredBlockManager(12, 4, S.KVTier(10), watermark=0)
    assert isinstance(bm, S.OffloadingBlockManager) and bm.tier.num_blocks == 10     # the engine's books
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12, 20)))] for _ in range(6)]
    for i in range(300):
        toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        s = Sequence(i, toks)
        hits = bm.get_computed_blocks(s)
        n = len(toks) - len(hits)*4
        if not bm.can_allocate(s, n, hits): continue
        bm.allocate(s, n, hits)
        bm.cache_blocks(s, len(toks))
        bm.take_transfers()
        assert bm.check_invariants() and len(bm.tier.slots) <= bm.tier.num_blocks
        bm.deallocate(s)
    m = bm.tier_metrics
    assert bm.num_used_blocks == 0 and bm.tier.hits > 0 and m["tier_blocks_loaded"] == bm.tier.hits//4
    assert bm.num_hits <= bm.num_queries and bm.check_invariants() and 0 < m["tier_usage_peak"] <= 1

def test_simulated_tier_hits_are_the_engines(tmp_path, monkeypatch):
    "The same chats on the real engine with a tier and in the simulator: the same hits, stores and loads."
    from helpers import tiny_hf_model
    from pagednb.engine import LLM
    from pagednb.sampling import SamplingParams
    tiny_hf_model("llama", tmp_path, vocab_size=2048, max_position_embeddings=512)   # the workload's ids < 1100
    monkeypatch.setitem(S.COST_MODELS, "cpu", S.CostModel(1e11, 1e10))           # as if calibrated
    knobs = dict(block_size=4, num_gpu_blocks_override=10, max_model_len=40, log=False)
    size = 6*4*LLM(str(tmp_path), **knobs).engine.kv_bytes_per_token/S.GiB          # a tier of 6 blocks
    llm = LLM(str(tmp_path), kv_offloading_size=size, **knobs)
    w = S.chat_sessions(3, turns=2, system_len=12, user_len=(4, 8), output_len=4, think_time=100.0, rate=0.01, seed=0)
    for i, r in sorted(enumerate(w.requests), key=lambda p: p[1].arrival_time):     # one at a time, as they arrive
        llm.generate([S.prompt_tokens(r, i)], SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True),
                     use_tqdm=False)
    bm = llm.engine.block_manager
    sim = S.Simulator(str(tmp_path), "cpu", kv_offloading_size=size, **S.engine_knob_values(llm))
    assert (sim.tier_blocks, sim.num_blocks) == (bm.tier.num_blocks, bm.num_blocks) == (6, 10)
    m, q = sim.run(w).metrics, bm.num_queries
    got = (m["tier_hit_rate"], m["pool_hit_rate"], m["tier_blocks_stored"], m["tier_blocks_loaded"])
    assert got == (bm.tier.hits/q, bm.num_hits/q, bm.tier.stored, bm.tier.loaded)
    assert bm.tier.loaded > 0 and bm.tier.evictions > 0

def test_lru_hit_rates_ceiling_and_monotone_tiers(trace):
    w = S.load_trace(trace)
    assert w.lru_hit_rates(10**6, block_size=512)["both"] == w.prefix_hit_ceiling(512)
    chats = [CHATS.lru_hit_rates(4096, t)["both"] for t in (0, 2048, 8192, 10**6)]
    assert chats == sorted(chats) and chats[-1] == pytest.approx(CHATS.prefix_hit_ceiling())

def test_tier_puzzle_reference_is_the_simulators_lookup():
    import random
    from collections import OrderedDict
    from pagednb.puzzles import get_puzzle
    p = get_puzzle("tier_lookup")
    for i in range(300):
        c = p.cases(random.Random(i))
        cap = (c["num_tokens"] - 1)//c["block_size"]
        hits = []
        for h in c["block_hashes"][:cap]:
            if h not in c["pool"]: break
            hits.append(c["pool"][h])
        t = S.KVTier(len(c["tier"]))
        t.blocks = OrderedDict.fromkeys(c["tier"])
        k = min(t.lookup(c["block_hashes"][len(hits):cap]), max(0, c["room"]))
        assert p.spec(**c) == (hits, c["block_hashes"][len(hits):len(hits) + k], list(t.blocks))

def test_vllm_command_and_start_up_line_name_the_tier(capsys):
    s = S.Simulator("Llama-3.1-8B", "H100-80GB", max_model_len=32768, kv_offloading_size=64)
    assert "KV offloading: 64 GiB of CPU memory, 32768 blocks (524288 tokens), over PCIe 5.0 x16" in capsys.readouterr().out
    assert s.vllm_command().endswith("--kv-offloading-size 64 --kv-offloading-backend native")
    assert "--kv-offloading" not in L31().vllm_command()

def test_sessions_keep_whole_conversations_of_the_real_trace():
    path = S.mooncake_trace_path()
    talks = {}                                                          # conversation (first two ids) -> its turns
    for line in gzip.open(path, "rt"):
        ids = json.loads(line)["hash_ids"]
        if len(ids) > 1: talks.setdefault(tuple(ids[:2]), []).append(ids)
    w = S.load_trace(path, sessions=40, seed=3, token_ids=False)
    kept = [r.hash_ids for r in w.requests]
    drawn = {tuple(h[:2]) for h in kept if len(h) > 1}
    multi = sorted(tuple(h) for h in kept if len(h) > 1)
    assert multi == sorted(tuple(h) for k in drawn for h in talks[k])  # every turn of a drawn conversation, no other
    assert len(drawn) + sum(len(h) < 2 for h in kept) == 40
    assert [r.arrival_time for r in w.requests] == sorted(r.arrival_time for r in w.requests)
    head = S.load_trace(path, max_requests=len(w), token_ids=False)      # the same number, from the trace's start
    assert w.prefix_hit_ceiling(16) > head.prefix_hit_ceiling(16)
    with pytest.raises(ValueError, match="sessions=0 is invalid"): S.load_trace(path, sessions=0)
