"""The trace and the step-through widgets on a real run of the embedded SmolLM2 with a tiny pool: the trace agrees with the
engine at every step, stepping / back / reset change exactly the figure data they should, a preemption shows its pages
freed, a shared page shows its reference count, JSON round trips; and one real browser (headless Debian chromium through
Playwright, every request off 127.0.0.1 blocked) clicking Step on the kernel-free page of a recorded trace."""
import contextlib, functools, http.server, os, shutil, threading
from pathlib import Path
import pytest
from pagednb.engine import LLM
from pagednb.model import load_model
from pagednb.sampling import SamplingParams
from pagednb.trace import Trace, tracing
from pagednb.widgets import EngineStepper, StepperState, embed_controls
from pagednb.figures import (geometry, map_panel, batch_panel, queue_panel, memory_series, map_figure, batch_figure,
                             queue_figure, trace_animation, trace_html)
from pagednb.compare_views import contiguous_vs_paged, prefix_sharing
from pagednb.plots import seq_color, _FREE, _CACHED

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a kind teacher. Explain computer memory with one short, concrete example."
PROMPTS = [f"{SYSTEM}\nQ: {q}\nA:" for q in ["What is a page?", "Why cache?", "What is a hash?", "Why share pages?"]]
KNOBS = dict(block_size=4, num_gpu_blocks_override=12, max_model_len=48, max_num_batched_tokens=16)

@pytest.fixture(scope="module")
def parts(): return load_model()

@pytest.fixture(scope="module")
def run(parts):
    "A real run (shared system prompt, chunked prefill, a preemption), its trace, and the engine's own state after every step."
    llm = LLM(parts, log=False, **KNOBS)
    truth = []
    def capture(e, plan, sampled):
        bm, sch = e.block_manager, e.scheduler
        truth.append(dict(ref=[b.ref_count for b in bm.blocks], state=[bm.block_state(b.block_id) for b in bm.blocks],
                          tables={s.seq_id: list(s.block_table) for s in sch.running}, freed={k: list(v) for k, v in plan.freed.items()},
                          batch=[(s.seq.seq_id, s.kind, s.start, s.num_new_tokens) for s in plan.scheduled], budget=plan.token_budget,
                          running=[s.seq_id for s in sch.running], waiting=[s.seq_id for s in sch.waiting],
                          usage=e.get_metrics()["kv_cache_usage"], sampled={k: list(v) if isinstance(v, list) else [v] for k, v in sampled.items()}))
    llm.engine.on_step = capture
    with tracing(llm) as tr:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert llm.engine.on_step is capture                          # detached: the hook that was there is back
    return tr, truth, outs

def figdata(st): return {k: [d.to_plotly_json() for d in f.data] for k, f in st.figs.items()}
def plain(traces): return [{k: v for k, v in t.items() if k != "uid"} for t in traces]

# ------------------------------------------------------------------------------------------------ the trace

def test_the_run_shares_chunks_and_preempts(run):
    tr, truth, outs = run
    assert len(tr) == len(truth) > 3
    assert any(s["kind"] == "prefill" and s["start"] + s["n"] < tr.seqs[str(s["seq"])]["prompt_len"] for st in tr.steps for s in st["scheduled"])
    assert any(st["shared"] for st in tr.steps) and any(st["preempted"] for st in tr.steps)
    assert tr.meta["model"] == "SmolLM2-135M-Instruct" and tr.meta["num_blocks"] == 12
    for o in outs:                                                # the trace's tokens are the outputs
        sid = next(k for k, e in tr.seqs.items() if e["request"] == o.request_id)
        assert tr.seqs[sid]["token_ids"][tr.seqs[sid]["prompt_len"]:] == o.outputs[0].token_ids

def test_trace_agrees_with_the_engine(run):
    tr, truth, _ = run
    for i, t in enumerate(truth):
        st, v = tr.steps[i], tr.step(i)
        assert st["ref"] == t["ref"]
        assert [b["state"] for b in v["blocks"]] == t["state"]
        assert {s["seq_id"]: s["block_table"] for s in v["seqs"] if s["status"] == "running"} == t["tables"]
        assert [(s["seq"], s["kind"], s["start"], s["n"]) for s in st["scheduled"]] == t["batch"] and st["budget"] == t["budget"]
        assert (st["running"], st["waiting"]) == (t["running"], t["waiting"])
        assert {int(k): v_ for k, v_ in st["sampled"].items()} == t["sampled"]
        assert abs(st["kv"]["usage"] - t["usage"]) < 1e-3
        for b in v["blocks"]:                                     # owners are the block tables that hold the page
            assert len(b["owners"]) == b["ref_count"]

def test_json_round_trip(run, tmp_path):
    tr = run[0]
    back = Trace.load(tr.save(tmp_path/"t.json"))
    assert back.to_dict() == tr.to_dict()
    assert [back.step(i) for i in range(len(back))] == [tr.step(i) for i in range(len(tr))]
    a, b = StepperState(tr), StepperState(back)
    assert [a.view(i) for i in range(len(tr))] == [b.view(i) for i in range(len(back))]
    with pytest.raises(ValueError, match="not a pagednb trace"): Trace.from_dict({"steps": []})
    assert tr.nbytes()["per_step"] < 2000                          # cheap: a few hundred bytes of JSON per step here

def test_attach_costs_nothing_when_off_and_chains(parts):
    llm = LLM(parts, log=False, **KNOBS)
    assert llm.engine.on_step is None
    seen = []
    llm.engine.on_step = lambda e, p, s: seen.append(1)
    tr = Trace.attach(llm)                                        # an LLM or its engine
    llm.generate([PROMPTS[0][:20]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(tr) == len(seen) > 0
    tr.detach(); assert llm.engine.on_step is not None and tr.engine is None
    with pytest.raises(TypeError, match="LLMEngine or an LLM"): Trace.attach(object())

# ------------------------------------------------------------------------------------------------ the stepper, state level

def test_step_back_reset_change_exactly_what_they_should(run):
    tr = run[0]
    st = EngineStepper(tr)
    geo = geometry(tr)
    before = figdata(st)
    st.step()
    after = figdata(st)
    assert (st.index, st.slider.value, st.play.value) == (1, 1, 1)
    fresh = dict(map=map_figure(tr, geo, 1), batch=batch_figure(tr, 1), queues=queue_figure(tr, 1))
    for k, fig in fresh.items():                                  # the figures show step 1's data, built from scratch ...
        assert plain(after[k]) == plain([d.to_plotly_json() for d in fig.data]), k
    assert after["map"] != before["map"] and after["batch"] != before["batch"]
    assert after["memory"][:-1] == before["memory"][:-1]          # ... the memory series do not move, only the cursor
    assert list(after["memory"][-1]["x"]) == [1, 1] and list(before["memory"][-1]["x"]) == [0, 0]
    assert [d.to_plotly_json() for d in st.figs["map"].data[8:]] == before["map"][8:]   # legend entries untouched
    st.back(); assert figdata(st) == before
    st.go(len(tr) + 10); assert st.index == len(tr) - 1 and st.slider.value == len(tr) - 1
    st.reset(); assert figdata(st) == before and st.index == 0
    st.back(); assert st.index == 0                               # clamped

def test_preemption_shows_its_pages_freed(run):
    tr, truth = run[0], run[1]
    st = EngineStepper(tr)
    k = next(i for i, t in enumerate(truth) if t["freed"])
    st.go(k)
    v = st.view(); pos = st.geo["pos"]
    victim, pages = next(iter(truth[k]["freed"].items()))
    freed_xy = set(zip(v["map"][3]["x"], v["map"][3]["y"]))
    assert {pos[b] for b in pages} <= freed_xy                    # a red cross on every page it gave back
    lane = st.geo["lanes"][k][victim]
    assert lane not in v["map"][0]["y"]                           # its lane holds no page now
    assert f"seq {victim} ⏸" in v["map"][5]["text"]
    colors = list(st.figs["map"].data[2].marker.color)
    for b in pages:                                               # the page is free, cached-free, or someone else's now
        assert colors[b] != seq_color(victim) or victim in [s for s, tb in truth[k]["tables"].items() if b in tb]
    waiting = [int(t.rstrip("⏸")) for t, y in zip(v["queues"][0]["text"], v["queues"][0]["y"]) if y == 1]
    assert waiting[0] == victim and f"{victim}⏸" in v["queues"][0]["text"]
    assert "preempted" in v["summary"]
    later = next(i for i in range(k + 1, len(tr)) if any(s["seq"] == victim for s in tr.steps[i]["scheduled"]))
    assert any(s["seq"] == victim and s["recompute"] for s in tr.step(later)["plan"]["scheduled"])   # it comes back and recomputes

def test_a_shared_page_shows_its_reference_count(run):
    tr, truth = run[0], run[1]
    st = EngineStepper(tr)
    k = next(i for i, t in enumerate(truth) if max(t["ref"]) > 1)
    st.go(k)
    pool = st.figs["map"].data[2]
    for b, r in enumerate(truth[k]["ref"]):
        assert (pool.text[b] == f"{b}×{r}") if r > 1 else (pool.text[b] == str(b))
        assert pool.marker.line.width[b] == (3 if r > 1 else 1)
        want = seq_color(min(s for s, tb in truth[k]["tables"].items() if b in tb)) if r else (_CACHED if truth[k]["state"][b] == "cached" else _FREE)
        assert pool.marker.color[b] == want
    b = truth[k]["ref"].index(max(truth[k]["ref"]))
    assert "ref_count" in pool.hovertext[b] and "tokens" in pool.hovertext[b] and "hash" in pool.hovertext[b]
    labels = st.view()["map"][0]
    assert labels["text"].count(str(b)) == truth[k]["ref"][b]      # that many logical pages point at it

def test_memory_panel_is_the_engine_metrics(run):
    tr, truth = run[0], run[1]
    usage = memory_series(tr)[0]["y"]
    assert all(abs(u - t["usage"]) < 1e-3 for u, t in zip(usage, truth))

def test_comparison_views_and_animation(run):
    tr = run[0]
    anim = trace_animation(tr)
    assert len(anim.frames) == len(tr)
    geo = geometry(tr)
    for i in (0, len(tr) - 1):
        assert list(anim.frames[i].data[2].marker.color) == map_panel(tr, i, geo)[2]["marker"]["color"]
    cvp = contiguous_vs_paged(tr)
    assert len(cvp.frames) == len(tr)
    cap = tr.meta["num_blocks"]*tr.meta["block_size"]
    assert max(sum(f.data[0].x) for f in cvp.frames) > cap        # a contiguous slab per request overflows this pool
    with pytest.raises(ValueError, match="reserve"): contiguous_vs_paged(tr, "everything")
    assert any("×" in lab for lab in prefix_sharing(tr).data[0].node.label)
    page = trace_html(tr, include_plotlyjs=False, full_html=False)
    assert "Step ▶" in page and "cdn." not in page

# ------------------------------------------------------------------------------------------------ live mode

def test_live_mode_add_step_rerun(parts):
    st = EngineStepper(LLM(parts, log=False, **KNOBS))
    assert st.live and len(st.trace) == 0 and st.view()["summary"] == "no steps yet"
    st.step_engine(); assert "nothing to run" in st.status.value
    with pytest.raises(ValueError, match="empty"): st.add_request("   ")
    st.add_request("The capital of France is", max_tokens=2)
    assert st.step_engine(1) == 1 and len(st.trace) == 1 and st.slider.max == 0
    st.run(); assert len(st.trace) == 2 and st.slider.value == 1 and not st.engine.has_unfinished_requests()
    st._safely(lambda: st.rerun(num_blocks=4))                    # a pool too small for one max_model_len sequence
    assert "max_model_len" in st.status.value and len(st.trace) == 2
    st.rerun(block_size=8, enable_prefix_caching=False)
    m = st.trace.meta
    assert (m["block_size"], m["enable_prefix_caching"], m["num_blocks"]) == (8, False, 12)
    assert len(st.trace) == 2 and st.index == 0 and list(st.trace.requests) == ["live-0"]
    with pytest.raises(ValueError, match="live engine"): EngineStepper(st.trace).rerun()
    with pytest.raises(TypeError, match="Trace, an LLM"): EngineStepper(42)

# ------------------------------------------------------------------------------------------------ one real browser

CHROMIUM = os.environ.get("PAGEDNB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDGET_JS = ROOT/"docs"/"_static"/"vendor"/"html-manager"          # @jupyter-widgets/html-manager, vendored by the docs
SCREENSHOT = Path(os.environ.get("PAGEDNB_SCREENSHOTS", ROOT/"docs"/"_build"/"screenshots"))/"widgets_stepper.png"

def _no_browser():
    try: import playwright.sync_api  # noqa: F401
    except ImportError: return "playwright is not installed (pip install playwright)"
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)): return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    if not (WIDGET_JS/"embed.js").exists(): return f"{WIDGET_JS/'embed.js'} is missing (the docs' vendored ipywidgets HTML manager)"

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a): pass

@contextlib.contextmanager
def _serve(root):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try: yield f"http://127.0.0.1:{srv.server_address[1]}/"
    finally: srv.shutdown(); srv.server_close()

_POOL = "() => { const gd = document.getElementById('pagednb-trace'); return [gd.getAttribute('data-step'), JSON.stringify(gd.data[2].marker.color), JSON.stringify(gd.data[2].text)]; }"

@pytest.mark.skipif(bool(_no_browser()), reason=str(_no_browser()))
def test_in_a_real_browser(run, tmp_path):
    "The embedded widget state and the recorded trace's animation, served locally: click Step, the page map changes."
    import plotly
    from playwright.sync_api import sync_playwright
    tr = run[0]
    shutil.copy(Path(plotly.__file__).parent/"package_data"/"plotly.min.js", tmp_path)
    for f in WIDGET_JS.iterdir():
        if f.suffix in (".js", ".woff2"): shutil.copy(f, tmp_path)
    embed_controls(tr, tmp_path/"stepper.html", widget_js="embed.js", include_plotlyjs="plotly.min.js")
    geo = geometry(tr)
    want = [map_panel(tr, i, geo)[2] for i in range(3)]
    with _serve(tmp_path) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        ctx = browser.new_context(viewport={"width": 1280, "height": 1000}, service_workers="block")
        blocked, errors = [], []
        ctx.route("**/*", lambda r: r.continue_() if r.request.url.startswith((base, "data:", "blob:")) else (blocked.append(r.request.url), r.abort()))
        page = ctx.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(base + "stepper.html", wait_until="load")
        page.wait_for_function("() => document.querySelector('#pagednb-trace svg.main-svg') && document.querySelector('.pagednb-controls .widget-readout')")
        step0, colors0, text0 = page.evaluate(_POOL)
        assert step0 == "0" and colors0 == json_list(want[0]["marker"]["color"])
        page.click("#pagednb-trace-step")                         # Step: the next frame
        page.wait_for_function("() => document.getElementById('pagednb-trace').getAttribute('data-step') === '1'")
        page.wait_for_timeout(300)
        step1, colors1, text1 = page.evaluate(_POOL)
        assert (colors1, text1) != (colors0, text0)               # the page map changed ...
        assert colors1 == json_list(want[1]["marker"]["color"]) and text1 == json_list(want[1]["text"])   # ... to step 1's pages
        assert "step 2/" in page.inner_text("#pagednb-trace-text")
        page.click(".pagednb-controls .ui-slider-handle, .pagednb-controls .noUi-handle")   # the embedded widget slider, no kernel
        page.keyboard.press("ArrowRight"); page.keyboard.press("ArrowRight")
        page.wait_for_function("() => document.getElementById('pagednb-trace').getAttribute('data-step') === '2'")
        assert page.evaluate(_POOL)[1] == json_list(want[2]["marker"]["color"])
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        ctx.close(); browser.close()
    assert not blocked, f"requests off the local server: {blocked}"
    assert not errors, errors

def json_list(xs):
    import json
    return json.dumps(list(xs), separators=(",", ":"), ensure_ascii=False)
