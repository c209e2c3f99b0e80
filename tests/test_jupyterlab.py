"""The steppers in a real Jupyter frontend: a JupyterLab server on 127.0.0.1 over copies of `05_scheduler` and
`08a_widgets`, headless Debian chromium (Playwright) running every cell with Run All, then looking at what a reader
sees: the stepper's plotly figures drawn (SVG paths), Step changing them, and in live mode Add request + Step engine
putting the new request in a lane of the page map. Skipped only where chromium is missing and cannot be installed."""
import os, time
from pathlib import Path
import pytest
from jupyter_browser import JupyterLab, Lab, no_chromium

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT/"nbs"
SHOTS = Path(os.environ.get("PAGEDNB_SCREENSHOTS", ROOT/"docs"/"_build"/"screenshots"))
STEPPER, LESSON = "08a_widgets.ipynb", "05_scheduler.ipynb"      # 05 is the quickest lesson that ends with a stepper

pytestmark = pytest.mark.skipif(bool(no_chromium()), reason=str(no_chromium()))

# Every plotly figure in a cell's output: its title, how many SVG paths it drew, its data and its drawing.
_FIGS = """(cell) => [...cell.querySelectorAll('.js-plotly-plot')].map(gd => {
    const svg = gd.querySelector('.plot-container svg.main-svg');
    return {title: ((gd.layout || {}).title || {}).text || '', paths: gd.querySelectorAll('svg.main-svg path').length,
            data: JSON.stringify((gd.data || []).map(t => [t.x, t.y, t.text, (t.marker || {}).color])),
            svg: svg ? svg.innerHTML : ''}; })"""
_WIDGET_ERRORS = """(cell) => [...cell.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent)
    .filter(t => /Error displaying widget|Failed to load model|model not found|Error creating widget/i.test(t))"""

@pytest.fixture(scope="module")
def lab():
    "One server for both notebooks, one browser; what the pages did wrong is checked at the end."
    import playwright.sync_api  # noqa: F401  (a dev dependency, as jupyterlab is: a missing one fails, it does not skip)
    import jupyterlab  # noqa: F401
    with JupyterLab([NBS/STEPPER, NBS/LESSON]) as server, Lab(server) as b:
        yield b
        assert not b.blocked, f"JupyterLab tried to reach outside 127.0.0.1: {sorted(set(b.blocked))[:10]}"

def _ran(b, name):
    page = b.open(name)
    state = b.run_all(page, name)
    print(f"\n{name}: Run All in {state['seconds']:.0f} s, {state['cells']} code cells")
    assert not state["errors"], f"{name}: cells failed in JupyterLab: {state['errors']}"
    assert not state["unrun"], f"{name}: cells left unrun: {state['unrun']}"
    return page

def _stepper(b, page, name, snippet, n_figs=4):
    "The output of the cell holding `snippet`, once its stepper's figures are drawn: (cell locator, figures)."
    cell = b.cell(page, name, snippet)
    cell.scroll_into_view_if_needed()
    page.wait_for_function("""(cell) => { const f = [...cell.querySelectorAll('.js-plotly-plot')];
        return f.length >= %d && f.every(gd => gd.querySelector('svg.main-svg path')); }""" % n_figs,
        arg=cell.element_handle(), timeout=60_000, polling=250)
    assert cell.evaluate(_WIDGET_ERRORS) == []
    figs = cell.evaluate(_FIGS)
    assert [f["title"] for f in figs[:4]] == ["pages", "batch (tokens)", "queues", "memory over time"], figs
    assert all(f["paths"] > 0 for f in figs), [(f["title"], f["paths"]) for f in figs]
    assert cell.evaluate(_POOL) > 0, "the page map draws no physical pool"
    return cell, figs

# The page map's physical pool: how many pages it draws (every page of the pool, at every step).
_POOL = "(c) => Array.from(c.querySelector('.js-plotly-plot').data[2].x || []).length"

def _click_and_wait(page, cell, label, before, timeout=30_000):
    """Click the widget button `label` in `cell`; wait until the page map is drawn differently from `before` (its SVG)
    and the stepper's figures have settled (a step arrives as a few updates: layout, then each figure's data)."""
    cell.locator("button.widget-button", has_text=label).first.click()
    page.wait_for_function("""([cell, before]) => { const gd = cell.querySelector('.js-plotly-plot');
        return !!gd && gd.querySelector('svg.main-svg').innerHTML !== before; }""", arg=[cell.element_handle(), before],
        timeout=timeout, polling=100)
    figs, t0 = cell.evaluate(_FIGS), time.time()
    while time.time() - t0 < timeout/1000:            # settled: the same drawing twice, a second apart
        page.wait_for_timeout(1000)
        now = cell.evaluate(_FIGS)
        if now == figs: return now
        figs = now
    raise TimeoutError(f"the stepper's figures kept changing after {label!r}")

def _shot(cell, name):
    SHOTS.mkdir(parents=True, exist_ok=True)
    cell.screenshot(path=str(SHOTS/name))

@pytest.fixture(scope="module")
def widgets_nb(lab):
    page = _ran(lab, STEPPER)
    yield page
    lab.shutdown(page, STEPPER)

def test_lesson_stepper_draws_and_steps(lab):
    "05_scheduler's stepper (the lesson's last cell): four figures drawn; Step changes the page map and the batch."
    page = _ran(lab, LESSON)
    try:
        cell, before = _stepper(lab, page, LESSON, "EngineStepper(tr)")
        assert "step 1/" in cell.locator(".widget-html").first.inner_text()
        after = _click_and_wait(page, cell, "Step ▶", before[0]["svg"])
        assert after[0]["data"] != before[0]["data"] and after[1]["data"] != before[1]["data"]   # page map, batch
        assert after[3]["data"] != before[3]["data"]                                         # the memory cursor moved
        assert "step 2/" in cell.locator(".widget-html").first.inner_text()
        assert cell.locator(".widget-readout").first.inner_text().strip() == "1"              # the slider followed
        _shot(cell, "jupyterlab-05_scheduler-stepper.png")
    finally:
        lab.shutdown(page, LESSON)
    assert not lab.errors, lab.errors

def test_widgets_stepper_steps(lab, widgets_nb):
    "08a's recorded stepper, left at the last step by the notebook: Reset, then Step, each redraws the figures."
    cell, figs = _stepper(lab, widgets_nb, STEPPER, "stepper = EngineStepper(tr)")
    reset = _click_and_wait(widgets_nb, cell, "« Reset", figs[0]["svg"])
    assert reset[0]["data"] != figs[0]["data"]
    step = _click_and_wait(widgets_nb, cell, "Step ▶", reset[0]["svg"])
    assert step[0]["data"] != reset[0]["data"] and step[2]["paths"] > 0
    _shot(cell, "jupyterlab-08a_widgets-stepper.png")

def test_live_add_request_and_step_engine_add_a_lane(lab, widgets_nb):
    "08a's live stepper (shown once, rerun since): type a prompt, Add request, Step engine: the new sequence gets a lane of pages."
    cell, figs = _stepper(lab, widgets_nb, STEPPER, "live = EngineStepper(LLM(")
    lanes = lambda: cell.evaluate("""(c) => { const d = c.querySelector('.js-plotly-plot').data;     // the page map
        return {labels: Array.from(d[5].text || []), pages_in: Array.from(d[0].y || [])}; }""")
    before = lanes()
    box = cell.locator(".widget-text input[placeholder^='type a prompt']").first
    box.fill("The capital of Italy is")
    box.press("Tab")
    cell.locator("button.widget-button", has_text="Add request").first.click()
    widgets_nb.wait_for_function("(c) => c.querySelector('.widget-text input[placeholder^=\"type a prompt\"]').value === ''",
                                 arg=cell.element_handle(), timeout=20_000)    # the kernel took the request and cleared the box
    _click_and_wait(widgets_nb, cell, "Step engine", figs[0]["svg"])
    after = lanes()
    new = [(lane, t) for lane, t in enumerate(after["labels"]) if t.startswith("seq ") and t not in before["labels"]]
    assert len(new) == 1, (before, after)                                          # one new lane, labelled with its sequence
    assert new[0][0] in after["pages_in"], (before, after)                         # and its logical pages drawn in it
    assert cell.evaluate(_POOL) > 0, "the page map draws no physical pool"
    status = cell.locator(".widget-html").last.inner_text()
    assert "Error" not in status, status
    assert "prefill" in cell.locator(".widget-html").first.inner_text()           # the step's text: the new prompt's prefill
    _shot(cell, "jupyterlab-08a_widgets-live.png")
    assert not lab.errors, lab.errors
