"""The stepper on hybrid models (sliding-window layers, several KV-cache groups), on tiny random models: the trace's
groups, null block and blocks a window left against the engine's own state, a lane per group in the page map with null
cells where the table holds the null block, the pages a window gave back marked on their step, one-group traces drawn
exactly as before, and attention over pages read through each layer's group table."""
import json, shutil
from pathlib import Path
import pytest, torch
from helpers import tiny_hybrid_model, HYBRID_FAMILIES
from pagednb.model import load_model, embedded_model_path
from pagednb.engine import LLM
from pagednb.sampling import SamplingParams
from pagednb.trace import Trace, tracing
from pagednb.figures import geometry, map_panel, map_figure, trace_animation
from pagednb.widgets import StepperState
from pagednb.attention_views import token_attention, page_attention, _reader

FIXTURES = Path(__file__).parent/"fixtures"

@pytest.fixture(scope="module", params=["gemma3", "mistral_swa"])
def hybrid(request, tmp_path_factory):
    "A tiny random model with windows (SmolLM2's tokenizer) and its engine."
    path = tmp_path_factory.mktemp(request.param)
    tiny_hybrid_model(request.param, path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (embedded_model_path()/f).exists(): shutil.copy(embedded_model_path()/f, path/f)
    parts = load_model(path, dtype="float32", device="cpu")
    return LLM(parts, log=False, block_size=4, num_gpu_blocks_override=80, max_model_len=128)

def _state(e, plan):
    return dict(tables={s.seq_id: [list(t) for t in s.block_tables] for s in e.block_manager.seqs.values()},
                window_freed={k: list(v) for k, v in plan.window_freed.items()})

@pytest.fixture(scope="module")
def run(hybrid):
    "A traced run of two requests (20 and 7 prompt tokens, 24 new), with the engine's own tables per step."
    truth = []
    hybrid.engine.on_step = lambda e, plan, sampled: truth.append(_state(e, plan))
    with tracing(hybrid) as tr:
        hybrid.generate([list(range(5, 25)), list(range(30, 37))],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    hybrid.engine.on_step = None
    return hybrid, tr, truth

def test_trace_records_groups_null_and_window_freed(run):
    llm, tr, truth = run
    groups = llm.engine.kv_groups
    assert tr.meta["kv_groups"] == [dict(window=g.window, layers=list(g.layers)) for g in groups]
    assert tr.meta["null_block"] == llm.engine.block_manager.null_block == 0
    assert any(t["window_freed"] for t in truth)
    for i, t in enumerate(truth):
        assert tr.steps[i].get("window_freed", {}) == {str(k): v for k, v in t["window_freed"].items()}
        got = [(w["seq"], w["block"]) for w in tr.window_freed(i)]
        assert got == [(int(k), b) for k, v in t["window_freed"].items() for b in v]
        assert all(w["group"] is not None and groups[w["group"]].window is not None for w in tr.window_freed(i))
    tr2 = Trace.from_dict(json.loads(tr.to_json()))
    assert tr2.window_freed(len(tr) - 1) == tr.window_freed(len(tr) - 1)

def test_lanes_per_group_and_null_cells(run):
    llm, tr, truth = run
    G, geo = len(llm.engine.kv_groups), geometry(tr)
    assert geo["num_lanes"] % G == 0 and geo["num_lanes"] >= 2*G
    for i, t in enumerate(truth):
        p, lanes = map_panel(tr, i, geo), geo["lanes"][i]
        assert len(p) == 10
        pages, nulls, labels = p[0], p[8], p[5]
        want_pages, want_nulls = set(), set()
        for sid, tables in t["tables"].items():
            for g, table in enumerate(tables):
                w = llm.engine.kv_groups[g].window
                name = "full" if w is None else f"window {w}"
                assert labels["text"][lanes[sid] + g].startswith(f"seq {sid} · {name}")
                for lg, b in enumerate(table):
                    (want_nulls if b == 0 else want_pages).add((lg, lanes[sid] + g, b))
        assert set(zip(pages["x"], pages["y"], map(int, pages["text"]))) == want_pages
        assert {(x, y, 0) for x, y in zip(nulls["x"], nulls["y"])} == want_nulls
        assert all("null block" in h for h in nulls["hovertext"])
    assert any(map_panel(tr, i, geo)[8]["x"] for i in range(len(tr)))

def test_window_freed_marked_in_the_pool(run):
    llm, tr, truth = run
    geo = geometry(tr)
    for i, t in enumerate(truth):
        marks, freed = map_panel(tr, i, geo)[9], [b for v in t["window_freed"].values() for b in v]
        assert list(zip(marks["x"], marks["y"])) == [geo["pos"][b] for b in freed]
        assert all("left the window of group" in h for h in marks["hovertext"])
        red = map_panel(tr, i, geo)[3]
        pool_freed = set(zip(red["x"], red["y"]))
        assert {geo["pos"][b] for b in freed} <= pool_freed           # also among the pages freed this step

def test_hybrid_figures_build(run):
    llm, tr, _ = run
    geo = geometry(tr)
    fig = map_figure(tr, geo, len(tr)//2)
    assert [d.name for d in fig.data[8:10]] == ["null (left the window)", "left a window now"]
    anim = trace_animation(tr)
    assert len(anim.frames) == len(tr) and len(anim.frames[0].data) == len(anim.frames[0].traces)
    st = StepperState(tr)
    assert len(st.view(len(tr) - 1)["map"]) == 10

def test_plain_trace_draws_as_before():
    "A one-group trace saved before hybrid models were drawn: the same page map, step by step."
    tr = Trace.load(FIXTURES/"stepper_plain_trace.json")
    assert "kv_groups" not in tr.meta and not any("window_freed" in s or "tables" in s for s in tr.steps)
    geo = geometry(tr)
    new = json.loads(json.dumps([map_panel(tr, i, geo) for i in range(len(tr))]))
    assert new == json.loads((FIXTURES/"stepper_plain_map.json").read_text())
    assert len(map_figure(tr, geo).data) == 11                      # 8 drawn, 3 legend keys: no window traces

def test_attention_reads_each_layer_through_its_group(hybrid):
    e = hybrid.engine
    for k, prompt in enumerate((list(range(5, 25)), list(range(30, 37)))):
        e.add_request(f"a{k}", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(12): e.step()
    bs = e.block_manager.block_size
    for s in e.scheduler.running:
        t = token_attention(e, s.seq_id)
        n = t["position"] + 1
        assert t["block_tables"] == [list(x[:(n - 1)//bs + 1]) for x in s.block_tables]
        for l, w in enumerate(t["windows"]):
            if w is None: continue
            before = max(0, n - w)
            assert float(t["weights"][l, :, :before].abs().sum()) == 0         # nothing before the window
            assert torch.allclose(t["weights"][l].sum(-1), torch.ones(1))
            assert float(t["pages"][l, :, :before//bs].sum()) == 0
        pos = n - 1
        with torch.inference_mode():                                  # its forward predicts the engine's next token
            h = e.runner.model(torch.tensor([s.token_ids[pos]]), torch.tensor([pos]), _reader(e.runner, s, bs, n))
        assert int(e.runner.model.compute_logits(h).argmax()) == s.token_ids[pos + 1]
    fig = page_attention(e)
    assert len(fig.data) == 2 and fig.frames[0].traces == (0, 1)
    wl = next(l for l, w in enumerate(token_attention(e, e.scheduler.running[0].seq_id)["windows"]) if w)
    grey = fig.frames[wl].data[1].z
    assert any(v == 1 for row in grey for v in row)                  # pages this windowed layer does not read
    while e.has_unfinished_requests(): e.step()
