"""One real browser (headless Debian chromium through Playwright, every request off 127.0.0.1 blocked) per newer view
of the stepper: the fork's copy-on-write in the page map, the speculation panel, attention over pages, `compare`,
latency and the one-request view. Each page is the figure's own kernel-free HTML with plotly.js from a local file;
each check looks at what was drawn (SVG), that it fits a 750-pixel docs column without sideways scrolling, and, for an
animated view, that moving to another frame draws that frame's data."""
import json, shutil
import pytest
from docs_browser import CHROMIUM, CHROMIUM_ARGS, have_browser, serve
from test_stepper_views import model_dir, parts, spec_run, attn_engine, ab, tier_run, PROMPTS, _run   # noqa: F401
from pagednb.engine import LLM
from pagednb.sampling import SamplingParams
from pagednb.trace import tracing
from pagednb.figures import geometry, map_figure, map_panel, spec_figure, spec_panel, latency_figure, trace_animation
from pagednb.compare_views import compare, logical_to_physical
from pagednb.attention_views import page_attention

pytestmark = pytest.mark.skipif(bool(have_browser()), reason=str(have_browser()))

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    import plotly
    from playwright.sync_api import sync_playwright
    root = tmp_path_factory.mktemp("views")
    shutil.copy(f"{plotly.__path__[0]}/package_data/plotly.min.js", root)
    with serve(root) as base, sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        ctx = b.new_context(viewport={"width": 750, "height": 900}, service_workers="block")
        blocked, errors = [], []
        ctx.route("**/*", lambda r: r.continue_() if r.request.url.startswith((base, "data:", "blob:"))
                  else (blocked.append(r.request.url), r.abort()))
        yield dict(root=root, base=base, ctx=ctx, blocked=blocked, errors=errors)
        ctx.close()
        b.close()
    assert not blocked, blocked

def _open(br, fig, name):
    "Serve `fig` as a page, open it, wait until plotly drew it; returns the page."
    fig.write_html(br["root"]/f"{name}.html", include_plotlyjs="plotly.min.js", div_id="fig", auto_play=False)
    page = br["ctx"].new_page()
    page.on("pageerror", lambda e: br["errors"].append(str(e)))
    page.goto(br["base"] + f"{name}.html", wait_until="load")
    page.wait_for_function("() => document.querySelector('#fig svg.main-svg path')")
    assert page.evaluate("document.documentElement.scrollWidth") <= 750, f"{name} scrolls sideways"
    assert page.evaluate("document.querySelectorAll('#fig svg.main-svg path').length") > 0
    return page

def _frame(page, name):
    "Show frame `name` as the slider would; wait until it is drawn."
    page.evaluate("""(n) => new Promise(ok => Plotly.animate('fig', [n], {mode: 'immediate', frame: {duration: 0,
                     redraw: true}, transition: {duration: 0}}).then(ok))""", str(name))
    page.wait_for_timeout(200)

_DATA = "(k) => JSON.parse(JSON.stringify(document.getElementById('fig').data[k]))"

def test_copy_on_write_in_a_browser(browser, parts):
    llm = LLM(parts, log=False, block_size=4, num_gpu_blocks_override=32, max_model_len=64)
    tr, truth = _run(llm, ["The capital of France is a"], SamplingParams(n=3, temperature=0.8, seed=1,
                                                                         max_tokens=6))
    k = next(i for i, t in enumerate(truth) if t["copies"])
    geo = geometry(tr)
    page = _open(browser, map_figure(tr, geo, k), "cow")
    arrow = page.evaluate(_DATA, 6)
    want = map_panel(tr, k, geo)[6]
    assert arrow["x"] == want["x"] and arrow["hovertext"] == want["hovertext"]
    orange = """[...document.querySelectorAll('#fig .scatterlayer path.point')]
                  .filter(p => (p.style.fill || '').includes('255, 127, 14')).length"""
    assert page.evaluate(orange) >= 2                                     # the arrow's two ends, drawn
    page.close()

def test_speculation_in_a_browser(browser, spec_run):
    tr = spec_run[0]
    geo = geometry(tr)
    k = next(i for i in range(len(tr)) if any(s["accepted"] < len(s["drafts"]) for s in tr.speculation(i)))
    page = _open(browser, spec_figure(tr, geo, k), "spec")
    texts = page.evaluate("[...document.querySelectorAll('#fig .bars text')].map(t => t.textContent)")
    assert texts == spec_panel(tr, k, geo)[0]["text"] and any(t.startswith("✗") for t in texts)
    page.close()

def test_attention_over_pages_in_a_browser(browser, attn_engine):
    fig = page_attention(attn_engine)
    page = _open(browser, fig, "attention")
    z0 = page.evaluate(_DATA, 0)["z"]
    last = len(fig.frames) - 1
    _frame(page, last)
    z1 = page.evaluate(_DATA, 0)["z"]
    assert z0 != z1 and z1 == [list(r) for r in fig.frames[last].data[0].z]
    page.close()

def test_compare_in_a_browser(browser, ab):
    (ta, _, _), (tb, _, _) = ab
    fig = compare(ta, tb)
    page = _open(browser, fig, "compare")
    k = min(len(ta), len(tb)) - 1
    _frame(page, k)
    got = page.evaluate(_DATA, 1)["marker"]["color"]
    assert got == list(fig.frames[k].data[1].marker.color)
    assert "pages in use" in page.evaluate("document.querySelector('#fig .gtitle').textContent")
    assert page.evaluate("document.querySelectorAll('#fig .table .cell-text').length") > 0
    page.close()

def test_latency_in_a_browser(browser, ab):
    tr = ab[0][0]
    page = _open(browser, latency_figure(tr, 2), "latency")
    n = page.evaluate("document.querySelectorAll('#fig .scatterlayer path.point').length")
    assert n >= sum(len(v["times"]) for v in tr.latency().values())      # a dot per token (and the legend's)
    page.close()

def test_one_request_and_the_stepper_animation_in_a_browser(browser, parts):
    llm = LLM(parts, log=False, block_size=4, num_gpu_blocks_override=8, max_model_len=32)
    with tracing(llm) as tr:
        llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6,
                                                                  ignore_eos=True), use_tqdm=False)
    fig = logical_to_physical(tr)
    page = _open(browser, fig, "one")
    last = len(fig.frames) - 1
    _frame(page, last)
    assert page.evaluate(_DATA, 2)["y"] == list(fig.frames[last].data[1].y)
    page.close()
    page = _open(browser, trace_animation(tr),
                 "stepper")              # the docs' stepper: one column, no sideways scroll
    page.close()
    assert not browser["errors"], browser["errors"]

def test_the_tier_lane_in_a_browser(browser, tier_run):
    tr, truth, _ = tier_run
    k = next(i for i, t in enumerate(truth) if t["loads"])
    geo = geometry(tr)
    page = _open(browser, map_figure(tr, geo, k), "tier")
    want = map_panel(tr, k, geo)
    assert page.evaluate(_DATA, 8)["marker"]["color"] == want[8]["marker"]["color"]      # the tier's slots
    assert page.evaluate(_DATA, 10)["x"] == want[10]["x"]                                  # the loads' arrows
    cyan = """[...document.querySelectorAll('#fig .scatterlayer path.point')]
                .filter(p => (p.style.fill + ' ' + p.style.stroke).includes('23, 190, 207')).length"""
    assert page.evaluate(cyan) >= 2                                       # a load's two ends, drawn
    said = page.evaluate("[...document.querySelectorAll('#fig .textpoint text')].map(t => t.textContent)")
    assert want[11]["text"][1] in said and "tier" in said
    page.screenshot(path=str(browser["root"]/"tier.png"))
    page.close()
