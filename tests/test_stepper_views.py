"""The stepper's newer views, each panel's data checked against the engine's own state at that step, on tiny
random-weight models: copy-on-write pairs against `plan.copies`, drafts against the spec decoder's records, attention
over pages against a torch recomputation from the same cache (and Hugging Face's eager attention), `compare`'s
differences against each trace's metrics, latency from the step times, and the one-request view's block table."""
import shutil
import pytest, torch
from helpers import tiny_hf_model
from pagednb.model import load_model, embedded_model_path
from pagednb.engine import LLM
from pagednb.sampling import SamplingParams
from pagednb.trace import Trace, tracing
from pagednb.widgets import EngineStepper
from pagednb.figures import (geometry, map_panel, spec_panel, spec_figure, latency_series, latency_figure,
                             has_speculation, MAX_WIDTH)
from pagednb.compare_views import compare, differences, trace_metrics, aligned_steps, logical_to_physical
from pagednb.attention_views import token_attention, page_attention, page_mass
from pagednb.plots import seq_color, FREE_COLOR

SYSTEM = "You are a kind teacher. Explain computer memory with one short, concrete example."
PROMPTS = [f"{SYSTEM}\nQ: {q}\nA:" for q in ["What is a page?", "Why cache?", "What is a hash?"]]

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    "A tiny random Llama with SmolLM2's tokenizer, saved as a Hugging Face folder."
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", path, vocab_size=49152, max_position_embeddings=512)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (embedded_model_path()/f).exists(): shutil.copy(embedded_model_path()/f, path/f)
    return path

@pytest.fixture(scope="module")
def parts(model_dir): return load_model(model_dir, dtype="float32", device="cpu")

def _state(e, plan):
    bm = e.block_manager
    return dict(copies=[list(c) for c in plan.copies], ref=[b.ref_count for b in bm.blocks],
                tables={s.seq_id: list(s.block_table) for s in bm.seqs.values()},
                allocated={k: list(v) for k, v in plan.allocated.items()},
                spec={k: dict(v) for k, v in e.spec.last.items()} if e.spec is not None else {})

def _run(llm, prompts, params):
    "Run `prompts` with a trace and our own record of the engine's state after every step."
    truth = []
    llm.engine.on_step = lambda e, plan, sampled: truth.append(_state(e, plan))
    with tracing(llm) as tr:
        llm.generate(prompts, params, use_tqdm=False)
    llm.engine.on_step = None
    return tr, truth

# ------------------------------------------------------------------------------------------------ copy-on-write

def test_copy_on_write_against_plan_copies(parts):
    llm = LLM(parts, log=False, block_size=4, num_gpu_blocks_override=32, max_model_len=64)
    tr, truth = _run(llm, ["The capital of France is a"], SamplingParams(n=3, temperature=0.8, seed=1,
                                                                         max_tokens=6))
    assert any(t["copies"] for t in truth)
    geo = geometry(tr)
    for i, t in enumerate(truth):
        cow = tr.copy_on_write(i)
        assert [[c["src"], c["dst"]] for c in cow] == t["copies"]
        m = map_panel(tr, i, geo)
        assert len([x for x in m[6]["x"] if x is not None]) == 2*len(cow)       # an arrow per copy
        for c in cow:
            assert c["src_ref"] == t["ref"][c["src"]] and c["src_ref_before"] == truth[i - 1]["ref"][c["src"]]
            assert t["tables"][c["seq"]][c["logical"]] == c["dst"]              # the copy is that sequence's page now
            assert f"copy of page {c['src']}" in m[2]["hovertext"][c["dst"]]
            assert any(f"copy of page {c['src']}" in h for h in m[6]["hovertext"])
            assert m[2]["marker"]["line"]["color"][c["src"]] == "#ff7f0e"      # its reference count changed
            assert (m[6]["x"][0], m[6]["y"][0]) == tuple(geo["pos"][cow[0]["src"]])

# ------------------------------------------------------------------------------------------------ speculation

@pytest.fixture(scope="module")
def spec_run(parts):
    cfg = dict(method="draft_model", model="self", num_layers=1, num_speculative_tokens=3)
    llm = LLM(parts, log=False, block_size=4, num_gpu_blocks_override=48, max_model_len=96,
              speculative_config=cfg)
    return _run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))

def test_drafts_against_the_spec_decoders_records(spec_run):
    tr, truth = spec_run
    assert has_speculation(tr)
    seen = dict(accepted=0, rejected=0, released=0)
    geo = geometry(tr)
    for i, t in enumerate(truth):
        specs = tr.speculation(i)
        assert {s["seq"] for s in specs} == set(t["spec"])
        for s in specs:
            rec = t["spec"][s["seq"]]
            assert [d["token"] for d in s["drafts"]] == rec["proposed"] and s["accepted"] == rec["num_accepted"]
            assert [d["fate"] for d in s["drafts"]] == ["accepted"]*rec["num_accepted"] + ["rejected"]*(len(rec["proposed"]) - rec["num_accepted"])
            assert s["kept"]["token"] == rec["bonus"]
            assert s["kept"]["fate"] == ("bonus" if rec["num_accepted"] == len(rec["proposed"]) else "recovered")
            if s["seq"] in t["tables"]:
                table = t["tables"][s["seq"]]
                assert s["released"] == [b for b in t["allocated"].get(s["seq"], []) if b not in table]
                assert all(b not in table for b in s["released"])
            for f in ("accepted", "rejected"): seen[f] += sum(d["fate"] == f for d in s["drafts"])
            seen["released"] += len(s["released"])
        bars = spec_panel(tr, i, geo)[0]
        want = [m for s in specs for m in ["✓"]*s["accepted"] + ["✗"]*(len(s["drafts"]) - s["accepted"]) + ["★"]]
        assert [x[0] for x in bars["text"]] == want
        owner = [s["seq"] for s in specs for _ in range(len(s["drafts"]) + 1)]
        assert all(c == seq_color(o) for c, o, x in zip(bars["marker"]["color"], owner,
                                                        bars["text"]) if x[0] == "✓")
        marks = map_panel(tr, i,
                          geo)[7]                                        # the pool: pages given slots back
        pages = {b for s in specs for b in s["released"] + [b for b, _ in s["slots"]]}
        assert {(x, y) for x, y in zip(marks["x"], marks["y"])} == {tuple(geo["pos"][b]) for b in pages}
    assert seen["accepted"] and seen["rejected"], seen

def test_the_stepper_draws_the_drafts_and_latency(spec_run):
    tr = spec_run[0]
    st = EngineStepper(tr)
    assert list(st.figs) == ["map", "batch", "queues", "memory", "spec", "latency"]
    k = next(i for i in range(len(tr)) if tr.speculation(i))
    st.go(k)
    assert list(st.figs["spec"].data[0].text) == spec_panel(tr, k, st.geo)[0]["text"]
    assert list(st.figs["latency"].data[-1].x) == [tr.steps[k]["time"]]*2
    assert st.figs["spec"].layout.width <= MAX_WIDTH and "drafts" in st.view()["summary"]

# ------------------------------------------------------------------------------------------------ attention over pages

@pytest.fixture(scope="module")
def attn_engine(parts):
    llm = LLM(parts, log=False, block_size=8, num_gpu_blocks_override=32, max_model_len=128)
    for j, p in enumerate(PROMPTS):                   # one a step: the later ones share the first one's cached pages
        llm.engine.add_request(f"r{j}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        llm.engine.step()
    assert len(llm.engine.scheduler.running) == 3
    return llm

def test_attention_against_torch_and_hugging_face(attn_engine, model_dir):
    from transformers import AutoModelForCausalLM
    e = attn_engine.engine
    sid = e.scheduler.running[1].seq_id
    seq = e.block_manager.seqs[sid]
    kv, tables = e.runner.kv_cache.clone(), {s: list(q.block_table) for s, q in e.block_manager.seqs.items()}
    t = token_attention(attn_engine, sid)                       # its last cached token
    assert torch.equal(kv, e.runner.kv_cache) and tables == {s: list(q.block_table) for s,
                                                             q in e.block_manager.seqs.items()}
    n, bs = t["position"] + 1, e.block_manager.block_size
    assert n == seq.num_computed_tokens and len(t["block_table"]) > 2
    L, H = t["weights"].shape[:2]
    assert t["weights"].shape == (L, H, n)
    assert torch.allclose(t["weights"].sum(-1), torch.ones(L, H), atol=1e-5)            # rows sum to 1
    assert torch.allclose(t["pages"].sum(-1), torch.ones(L, t["pages"].shape[1]), atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                              torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([seq.token_ids[:n]]), output_attentions=True, output_hidden_states=True)
    for layer in range(L):
        assert torch.allclose(t["weights"][layer], out.attentions[layer][0, :, n - 1, :n], atol=1e-4), layer
    # the same weights from the cache by hand: Hugging Face's query of the token against K read through the block table
    a = hf.model.layers[0].self_attn
    x = hf.model.layers[0].input_layernorm(out.hidden_states[0][0])
    q = a.q_proj(x).view(n, H, -1).transpose(0, 1)
    cos, sin = hf.model.rotary_emb(x[None], torch.arange(n)[None])
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q = apply_rotary_pos_emb(q[None], q[None], cos, sin)[0][0, :, n - 1]                 # [heads, head dim]
    slots = [seq.block_table[p//bs]*bs + p % bs for p in range(n)]
    K = e.runner.kv_cache[0, 0].flatten(0,
                                        1)[slots].repeat_interleave(H//e.model_config.num_key_value_heads, 1)
    ref = torch.softmax(torch.einsum("hd,nhd->hn", q.detach(), K)*e.runner.attn.scale, -1)
    assert torch.allclose(t["weights"][0], ref, atol=1e-4)
    assert torch.allclose(t["pages"], page_mass(t["weights"], bs, e.model_config.num_key_value_heads))
    assert torch.allclose(t["pages"][0, 0, 0], ref[:H//2, :bs].sum(-1).mean(),
                          atol=1e-4)     # kv group 0, page 0

def test_page_attention_lays_pages_out_as_the_pool(attn_engine):
    e = attn_engine.engine
    fig = page_attention(attn_engine)
    queries = fig.layout.meta["queries"]
    assert [q[0] for q in queries] == [s.seq_id for s in e.scheduler.running]
    assert list(fig.data[0].x) == [str(b) for b in range(e.block_manager.num_blocks)]
    G = e.model_config.num_key_value_heads
    shared = [b.block_id for b in e.block_manager.blocks if b.ref_count == 3]
    assert shared
    L = e.model_config.num_hidden_layers
    assert len(fig.frames) == L
    for layer in (0, L - 1):
        z = fig.frames[layer].data[0].z
        for r, (sid, pos) in enumerate(queries):
            t = token_attention(attn_engine, sid, pos)
            for g in range(G):
                row = z[r*G + g]
                assert [b for b, v in enumerate(row) if v is not None] == sorted(t["block_table"])
                for lg, b in enumerate(t["block_table"]):
                    assert abs(row[b] - float(t["pages"][layer, g, lg])) < 1e-4
                assert abs(sum(v for v in row if v is not None) - 1) < 1e-3
                assert all(row[b] is not None for b in shared)           # a shared page is read by every request
    assert fig.layout.width <= MAX_WIDTH
    with pytest.raises(ValueError, match="cached for positions"): token_attention(attn_engine,
                                                                                  queries[0][0], 10_000)
    with pytest.raises(ValueError, match="holds no pages"): token_attention(attn_engine, 999)

# ------------------------------------------------------------------------------------------------ compare and latency

@pytest.fixture(scope="module")
def ab(parts):
    knobs = dict(block_size=4, num_gpu_blocks_override=20, max_model_len=64, max_num_batched_tokens=32)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = []
    for pc in (True, False):
        llm = LLM(parts, log=False, enable_prefix_caching=pc, **knobs)
        tr, truth = _run(llm, PROMPTS, sp)
        out.append((tr, truth, llm.engine.get_metrics()))
    return out

def test_compare_differences_against_each_traces_metrics(ab):
    (ta, ua, ma), (tb, ub, mb) = ab
    d = differences(ta, tb)
    for side, t, u, m in (("a", ta, ua, ma), ("b", tb, ub, mb)):
        assert d["steps"][side] == len(t) == len(u)
        assert d["pages in use"][side] == max(sum(r > 0 for r in x["ref"]) for x in u)
        assert d["preemptions"][side] == m["num_preemptions"]
        assert d["hit rate"][side] == round(m["prefix_cache_hit_rate"], 4)
        lat = t.latency()
        assert d["TTFT (s)"][side] == round(sum(v["ttft"] for v in lat.values())/len(lat), 4)
    assert d["hit rate"]["a"] > 0 == d["hit rate"]["b"]
    assert d["steps"]["delta"] == len(tb) - len(ta)
    fig = compare(ta, tb)
    assert len(fig.frames) == max(len(ta), len(tb)) and fig.layout.width <= MAX_WIDTH
    assert fig.layout.meta["differences"] == d
    k = min(len(ta), len(tb)) - 1
    now = differences(ta, tb, k, k)
    assert now["pages in use"]["a"] == sum(r > 0 for r in ua[k]["ref"]) and now["steps"]["b"] == k + 1
    assert f"pages in use {now['pages in use']['a']} vs {now['pages in use']['b']}" in fig.frames[k].layout.title.text
    assert list(fig.frames[k].data[0].marker.color) == [seq_color(min(s for s,
                                                                      tb_ in ua[k]["tables"].items() if b in tb_))
                                                       if r else c for b, (r,
                                                                           c) in enumerate(zip(ua[k]["ref"], fig.frames[k].data[0].marker.color))]
    by_time = aligned_steps(ta, tb, "time")
    assert [f[1] for f in by_time] == sorted(f[1] for f in by_time) and by_time[-1][1:] == (len(ta) - 1,
                                                                                            len(tb) - 1)
    for lab, ia, ib in by_time:
        t = float(lab.split()[0])
        assert ta.steps[ia]["time"] <= t + 0.005 or ia == 0
    with pytest.raises(ValueError, match="align must be"): compare(ta, tb, align="tokens")
    with pytest.raises(TypeError, match="two Trace"): compare(ta, {"steps": []})
    with pytest.raises(ValueError, match="empty"): compare(ta, Trace(meta=ta.meta))

def test_latency_from_the_step_times(ab):
    tr = ab[0][0]
    lat = tr.latency()
    for sid, v in lat.items():
        e = tr.seqs[str(sid)]
        steps = [st for st in tr.steps if str(sid) in st["sampled"]]
        assert v["ttft"] == round(steps[0]["time"] - (tr.steps[e["first_step"] - 1]["time"] if e["first_step"] else 0), 6)
        assert v["tokens"] == e["token_ids"][e["prompt_len"]:][:len(v["tokens"])] and len(v["tokens"]) == 6
        assert v["max_gap"] == max(v["gaps"])
    s = latency_series(tr)
    assert len([x for x in s[1]["x"]]) == sum(len(v["times"]) for v in lat.values())
    assert latency_figure(tr).layout.width <= MAX_WIDTH

def test_rerun_keeps_the_previous_trace(parts):
    st = EngineStepper(LLM(parts, log=False, block_size=4, num_gpu_blocks_override=20, max_model_len=64))
    st.add_request("The capital of France is", max_tokens=3)
    st.run()
    first = st.trace
    st.rerun(block_size=8)
    assert st.previous is first and st.trace is not first and len(st.previous) and len(st.trace)
    assert differences(st.previous, st.trace)["steps"]["a"] == len(first)

# ------------------------------------------------------------------------------------------------ one request

def test_logical_to_physical_follows_the_block_table(parts):
    llm = LLM(parts, log=False, block_size=4, num_gpu_blocks_override=8, max_model_len=32)
    tables = []
    llm.engine.on_step = lambda e, plan, s: tables.append([list(q.block_table) for q in e.block_manager.seqs.values()])
    with tracing(llm) as tr:
        llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8,
                                                                  ignore_eos=True), use_tqdm=False)
    table = max((t[0] for t in tables if t), key=len)
    fig = logical_to_physical(tr)
    n = len(fig.frames)
    assert n == min(len(tr.seqs["0"]["token_ids"]), len(table)*4)
    for t in (0, n - 1):
        f = fig.frames[t].data
        assert list(f[0].y) == [p//4 for p in range(t + 1)]                       # logical block of each token
        assert list(f[1].y) == [table[p//4] for p in range(t + 1)]                # its physical block (row = page id)
        assert f[3].text[-1].startswith(f"→ {table[t//4]} ")
    assert fig.layout.width <= MAX_WIDTH
    with pytest.raises(ValueError, match="not in this trace"): logical_to_physical(tr, 42)

# ------------------------------------------------------------------------------------------------ host tier

@pytest.fixture(scope="module")
def tier_run(parts):
    "Three prompts one at a time on a pool of 9 pages and a tier of 8 slots: the second evicts the first to the tier."
    probe = LLM(parts, log=False, block_size=4, num_gpu_blocks_override=9, max_model_len=36)
    size = 8*4*probe.engine.kv_bytes_per_token/2**30                    # 8 pages of 4 tokens, every layer
    llm = LLM(parts, log=False, block_size=4, num_gpu_blocks_override=9, max_model_len=36, kv_offloading_size=size)
    truth = []
    held = lambda e: {k: h[:4].hex() for h, k in e.block_manager.tier.slots.items()}
    pairs = lambda ps: [list(p) for p in ps]
    moved = lambda plan: dict(stores=pairs(plan.offload.stores), loads=pairs(plan.offload.loads))
    llm.engine.on_step = lambda e, plan, s: truth.append(dict(slots=held(e), **moved(plan)))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    other = "Tell me a long story about a cat who lived in a big old house near the sea, and"
    with tracing(llm) as tr:
        for p in (PROMPTS[0], other, PROMPTS[1]): llm.generate([p], sp, use_tqdm=False)
    return tr, truth, llm

def test_the_tier_lane_against_the_engines_tier(tier_run):
    tr, truth, llm = tier_run
    n = llm.engine.block_manager.tier.num_blocks
    assert tr.meta["tier_blocks"] == n == 8
    tiers, geo = tr.tier_slots(), geometry(tr)
    assert any(t["loads"] for t in truth) and any(t["stores"] for t in truth)
    for i, (t, want) in enumerate(zip(tiers, truth)):
        assert t["slots"] == [want["slots"].get(k) for k in range(n)]                # every slot, every step
        assert [[s["block"], s["slot"]] for s in t["stored"]] == want["stores"]
        assert [[s["slot"], s["block"]] for s in t["loaded"]] == want["loads"]
        m = map_panel(tr, i, geo)
        assert len(m) == 12 and len(m[9]["x"]) == 3*len(want["stores"]) and len(m[10]["x"]) == 3*len(want["loads"])
        assert m[11]["text"][1].endswith(f"stored {len(want['stores'])}, loaded {len(want['loads'])}")
        for k, (h, who) in enumerate(zip(t["slots"], t["owners"])):
            assert (m[8]["marker"]["color"][k] == FREE_COLOR) == (h is None)
            if who: assert m[8]["marker"]["color"][k] == seq_color(who[0])
    k = next(i for i, t in enumerate(truth) if t["loads"])
    slot, block = truth[k]["loads"][0]
    m = map_panel(tr, k, geo)
    assert (m[10]["x"][0], m[10]["y"][0]) == geo["tier"]["pos"][slot]                  # from the slot
    assert (m[10]["x"][1], m[10]["y"][1]) == geo["pos"][block]                         # to the pool's page
    pool_rows = -(-tr.meta["num_blocks"]//geo["cols"])
    assert geo["tier"]["y0"] == geo["y0"] + pool_rows + 1                       # below the pool, a row apart
    assert EngineStepper(tr).view(k)["map"] == m and "host tier: " in EngineStepper(tr).view(k)["summary"]

def test_no_tier_draws_no_lane(ab):
    tr = ab[0][0]
    geo = geometry(tr)
    assert "tier" not in geo and "tier_blocks" not in tr.meta and len(map_panel(tr, 0, geo)) == 8

def test_the_live_stepper_draws_the_tier(tier_run):
    llm = tier_run[2]
    st = EngineStepper(llm)
    st.add_request(PROMPTS[2], max_tokens=3)
    st.run()
    assert st.trace.meta["tier_blocks"] == 8 and "tier" in st.geo
    fig, v = st.figs["map"], st.view()
    assert [d.name for d in fig.data[9:11]] == ["stored to the tier", "loaded from the tier"]
    assert list(fig.data[8].marker.color) == v["map"][8]["marker"]["color"]          # the slots as the view has them
    assert len(fig.data[8].x) == 8 and fig.layout.height >= 110 + 28*st.geo["rows"]
