"""Helpers for tests/test_docs.py: serve a built docs site on a loopback port, look at it with headless Debian
chromium through Playwright (every request outside that server blocked), and check its links without a browser."""
import contextlib, functools, html.parser, http.server, os, posixpath, shutil, threading
from pathlib import Path
from urllib.parse import urljoin, urlsplit, unquote

CHROMIUM = os.environ.get("PAGEDNB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

def have_browser():
    "Why the browser test cannot run here, or None when it can."
    try: import playwright.sync_api  # noqa: F401
    except ImportError: return "playwright is not installed (pip install playwright)"
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)): return f"{CHROMIUM} is missing (apt-get install -y chromium)"

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a): pass

@contextlib.contextmanager
def serve(root):
    "Serve the folder `root` at http://127.0.0.1:PORT/ (a free port) while in the block; yields the base URL."
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    t = threading.Thread(target=srv.serve_forever, daemon=True); t.start()
    try: yield f"http://127.0.0.1:{srv.server_address[1]}/"
    finally: srv.shutdown(); srv.server_close()

# ------------------------------------------------------------------------------ links, without a browser

class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(); self.ids, self.hrefs = set(), []
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("id", "name") if tag == "a" else ("id",):
            if a.get(k): self.ids.add(a[k])
        if tag == "a" and a.get("href"): self.hrefs.append(a["href"])

def broken_internal_links(root):
    "[(page, href, why)] for every link between pages of the site whose file or #anchor does not exist."
    root = Path(root); parsed = {}
    def parse(f):
        if f not in parsed:
            p = _Links(); p.feed(f.read_text(encoding="utf-8", errors="replace")); parsed[f] = p
        return parsed[f]
    bad = []
    for f in sorted(root.rglob("*.html")):
        rel = f.relative_to(root).as_posix()
        for href in parse(f).hrefs:
            u = urlsplit(href)
            if u.scheme or u.netloc or href.startswith(("mailto:", "javascript:")): continue
            target = f if not u.path else root/posixpath.normpath(posixpath.join(posixpath.dirname(rel), unquote(u.path)))
            if target.is_dir(): target = target/"index.html"
            if not target.exists(): bad.append((rel, href, "no such file")); continue
            if u.fragment and target.suffix == ".html" and unquote(u.fragment) not in parse(target).ids:
                bad.append((rel, href, "no such anchor"))
    return bad

# ------------------------------------------------------------------------------ the browser

_WAIT_FIGURES = """() => [...document.querySelectorAll('.plotly-graph-div')].every(d => d.querySelector('svg.main-svg'))"""
_WAIT_WIDGETS = """() => [...document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')]
    .every(s => s.previousElementSibling && s.previousElementSibling.classList.contains('widget-subarea')
                && s.previousElementSibling.children.length > 0)"""
_WAIT_MATH = """() => !document.querySelector('.math') || !!document.querySelector('mjx-container')"""
_PAGE_FACTS = """() => ({
  figures: document.querySelectorAll('.plotly-graph-div').length,
  drawn: [...document.querySelectorAll('.plotly-graph-div')].filter(d => d.querySelector('svg.main-svg')).length,
  animations: [...document.querySelectorAll('.plotly-graph-div')].filter(d => (d._transitionData && d._transitionData._frames || []).length > 0).length,
  widgets: document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]').length,
  widgets_drawn: document.querySelectorAll('.widget-subarea > *').length,
  widget_errors: [...document.querySelectorAll('.jupyter-widgets')].filter(e => e.children.length === 0 &&
                   /^(Error displaying widget|Error creating widget|Could not create)/.test(e.textContent.trim())).length
                 + document.querySelectorAll('.jupyter-widgets-error-widget').length,
  math: document.querySelectorAll('mjx-container').length,
  // controls that need a kernel the site does not have: ipywidgets buttons, text boxes, dropdowns, checkboxes
  dead_controls: document.querySelectorAll('.widget-button, .widget-text input, .widget-dropdown select, .widget-checkbox input').length,
  steppers: document.querySelectorAll('.pagednb-stepper').length,
  steppers_drawn: [...document.querySelectorAll('.pagednb-stepper')].filter(s => s.querySelector('.plotly-graph-div svg.main-svg path')).length,
  title: document.title,
  headings: [...document.querySelectorAll('h1, h2, h3')].map(h => h.textContent.replace(/[\\s#¶]+$/, '').trim()),
})"""

class Browser:
    "Headless chromium for one site: `visit(path)` loads a page and returns what it found, errors included."
    def __init__(self, base):
        self.base = base
    def __enter__(self):
        from playwright.sync_api import sync_playwright
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        self.ctx = self.browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
        self.blocked = []
        def route(r):
            if r.request.url.startswith(self.base) or r.request.url.startswith(("data:", "blob:")): r.continue_()
            else: self.blocked.append(r.request.url); r.abort()
        self.ctx.route("**/*", route)
        return self
    def __exit__(self, *a):
        self.ctx.close(); self.browser.close(); self._pw.stop()

    def visit(self, path, screenshot=None, focus=None, timeout=30_000):
        "Load `path`; wait for widgets, figures and math; a screenshot with the element `focus` (CSS) in view, if given."
        page = self.ctx.new_page()
        errors = []
        page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url} ({r.failure})"))
        page.on("response", lambda r: errors.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
        try:
            page.goto(urljoin(self.base, path), wait_until="load", timeout=timeout)
            for what, js in (("widgets", _WAIT_WIDGETS), ("plotly figures", _WAIT_FIGURES), ("math", _WAIT_MATH)):
                try: page.wait_for_function(js, timeout=timeout)
                except Exception: errors.append(f"{what} not drawn within {timeout/1000:.0f} s")
            page.wait_for_timeout(200)
            facts = page.evaluate(_PAGE_FACTS)
            if screenshot:
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                page.evaluate("""() => document.querySelectorAll('.plotly-graph-div').forEach(d => {
                    if ((d._transitionData && d._transitionData._frames || []).length) d.classList.add('has-frames'); })""")
                top = 0
                if focus and page.locator(focus).count():     # a viewport's worth of the page, the element `focus` in it
                    top = page.locator(focus).first.evaluate("e => Math.max(0, e.getBoundingClientRect().top + window.scrollY - 150)")
                height = page.evaluate("() => document.documentElement.scrollHeight")
                top = max(0, min(top, height - 900))
                page.screenshot(path=str(screenshot), full_page=True, clip=dict(x=0, y=top, width=1280, height=900))
            facts["errors"] = errors
            facts["page"] = page
            return facts
        except Exception as e:
            errors.append(f"could not load: {e}")
            return dict(errors=errors, page=page)

    def play_first_animation(self, page, wait_ms=2500):
        "Press the first plotly Play button on `page`; the frame shown before and after (by slider position or data)."
        js_state = """() => { const d = [...document.querySelectorAll('.plotly-graph-div')]
                         .find(d => (d._transitionData && d._transitionData._frames || []).length > 0);
                       if (!d) return null;
                       const s = (d.layout.sliders || [])[0];
                       return JSON.stringify([s ? s.active : null, d.data.map(t => t.y || t.z || t.x)]); }"""
        before = page.evaluate(js_state)
        btn = page.locator(".plotly-graph-div .updatemenu-button").first
        if before is None or not btn.count(): return before, None
        btn.click(); page.wait_for_timeout(wait_ms)
        return before, page.evaluate(js_state)

    def step_stepper(self, page, k=0, clicks=2):
        """Click Step on the `k`-th stepper of `page` (its kernel-free copy) `clicks` times; (before, after), each the
        JSON of [the step shown, the figure's data, its drawing (SVG)]."""
        state = """(k) => { const gd = document.querySelectorAll('.pagednb-stepper .plotly-graph-div')[k];
                       return JSON.stringify([gd.getAttribute('data-step'), gd.data.map(t => [t.x, t.y, t.text, (t.marker || {}).color]),
                                              gd.querySelector('svg.main-svg').innerHTML]); }"""
        before = page.evaluate(state, k)
        step = page.locator(".pagednb-stepper button[id$='-step']").nth(k)
        for _ in range(clicks):
            step.click(); page.wait_for_timeout(400)
        return before, page.evaluate(state, k)
