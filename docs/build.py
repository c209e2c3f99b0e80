#!/usr/bin/env python3
"""Build the pagednb docs site from nbs/ into docs/_build/html: every lesson with its executed outputs,
interactive plotly figures and saved widget state, the API reference, search; no network needed, ever.

    .venv/bin/python docs/build.py              # the whole site -> docs/_build/html/index.html
    .venv/bin/python docs/build.py --force      # also re-execute notebooks whose last run is still valid
    .venv/bin/python docs/build.py 02 kv_cache  # only the lessons whose file names contain one of these
    .venv/bin/python docs/build.py --reuse      # a layout check: keep every notebook's last run even if the package changed
    .venv/bin/python docs/build.py --execute-only --jobs 1 00_kv_cache.ipynb   # run one lesson as the tests do, keep the run

What it does, all under docs/_build (the notebooks in nbs/ are only read):
1. nbdev's doc processors (the ones `nbdev-proc-nbs` runs) on a copy of each notebook: `#| hide` cells go,
   `#| export` cells become `show_doc` API docs, names in backticks link to where they are documented.
2. Each copy runs top to bottom in a Jupyter kernel of this interpreter, in nbs/, two at a time, skipping
   the cells nbdev-test skips (`#| notest`, `#| gpu`, `#| eval: false`). A notebook whose processed text and
   the package's code are unchanged since its last run reuses that run (docs/_build/exec).
3. Sphinx with myst-nb renders the pages (furo theme) in teaching order: the README as the landing page,
   the lessons in file-name order, an API page per module. plotly.js, MathJax and the widget manager are
   served from the site's _static folder.
4. `check_offline` fails the build if any page would load a script, style, font, image or frame from
   outside the site, and Sphinx warnings (unknown output types, broken references) fail it too.
"""
import argparse, hashlib, html, importlib, json, os, pkgutil, posixpath, re, shutil, subprocess, sys, time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

# jsonschema (under nbformat) compiles 38 grammars of an optional URI checker at import, 6 s a process, for a
# format no notebook uses: leave that checker out
sys.modules.setdefault("rfc3987_syntax", None)

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
BUILD_VERSION = "1"                      # bump when a change here alters what execution produces: reruns every notebook

class BuildError(Exception): pass

# ---------------------------------------------------------------------------------------------- helpers

def _log(*a): print("[docs]", *a, flush=True)

def _write(path: Path, text: str):
    "Write `text` only if it differs, so Sphinx re-reads only pages that changed."
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text: path.write_text(text, encoding="utf-8")

def _cfg():
    from nbdev.config import get_config
    return get_config(ROOT)

def page_name(nb_path: Path) -> str:
    "The page a notebook becomes, as nbdev names it: `00_kv_cache.ipynb` -> `kv_cache`."
    from nbdev.config import nbpath2html
    return nbpath2html(Path(nb_path.name)).stem

def notebooks(nbs: Path, only=()):
    "Lesson notebooks in teaching (file-name) order; nbdev skips names starting with `_` or `.`."
    nbs_ = [p for p in sorted(nbs.glob("*.ipynb")) if not re.match(r"[_.]", p.name)]
    if only: nbs_ = [p for p in nbs_ if any(o in p.name for o in only)]
    seen = {}
    for p in nbs_:
        n = page_name(p)
        if n in ("index", "search", "genindex") or n.startswith("api"):
            raise BuildError(f"{p.name}: its page name '{n}' is taken by the site itself; rename the notebook")
        if n in seen: raise BuildError(f"{seen[n].name} and {p.name} would both become the page '{n}.html'; rename one")
        seen[n] = p
    return nbs_

def nb_title(nb_path: Path):
    "The `# Title` of a notebook's first markdown cell, or None."
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    md = next((c for c in nb["cells"] if c["cell_type"] == "markdown"), None)
    m = re.search(r"^#\s+(.+?)\s*$", "".join(md["source"]), flags=re.M) if md else None
    return m.group(1) if m else None

def default_exp(nb_path: Path):
    "The module a notebook exports to (`#| default_exp`), or None."
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    for c in nb["cells"]:
        if c["cell_type"] != "code": continue
        m = re.search(r"^\s*#\|\s*default_exp\s+(\S+)", "".join(c["source"]), flags=re.M)
        if m: return m.group(1)

# ------------------------------------------------------------------------------ 1. before execution

# The first cell of every processed notebook (hidden from the page): plotly figures are emitted as plotly's own
# JSON mimetype, which step 3 turns into a div + Plotly.newPlot call that uses the site's plotly.js.
SETUP_CELL = """#| hide
import plotly.io as _pagednb_pio
_pagednb_pio.renderers.default = "plotly_mimetype"
del _pagednb_pio
from nbdev.showdoc import show_doc
"""

def preprocess(nb_path: Path, cfg):
    "The notebook as it will be executed: show_doc cells added after exports, skipped cells tagged, set-up cell first."
    import nbformat
    from fastcore.nbio import read_nb, nb2str, mk_cell
    from nbdev.process import NBProcessor
    from nbdev.processors import add_show_docs
    nb = read_nb(nb_path)
    NBProcessor(nb=nb, procs=[add_show_docs], rm_directives=False).process()
    flags = str(cfg.get("tst_flags", "")).split()
    try:
        from nbdev.test import _skip_cell          # exactly the cells nbdev-test leaves out
        skip = _skip_cell(nb, flags)
    except ImportError:                             # (a private helper: should it move, the same rule by hand)
        skip = lambda c: (set(flags) & set(c.directives_ or {})) or str((c.directives_ or {}).get("eval", "")).lower() == "false"
    for c in nb.cells:
        md = c.setdefault("metadata", {})
        if c.pop("has_sd", False):
            md["pagednb_docs"] = "show_doc"
            c["id"] = "sd-" + hashlib.sha1(f"{c.source}{c.idx_}".encode()).hexdigest()[:8]   # stable: the run cache keys on the text
        if c.cell_type != "code" or not skip(c): continue
        shown = sorted(set(flags) & set(c.directives_ or {}))
        md["tags"] = list(md.get("tags", [])) + ["skip-execution"] + [f"pagednb-{f}" for f in shown or ["noeval"]]
    nb.cells.insert(0, mk_cell(SETUP_CELL, metadata={"pagednb_docs": "setup"}, id="pagednb-docs-setup"))
    return nbformat.reads(nb2str(nb), as_version=4)

def _package_fingerprint(cfg) -> str:
    h = hashlib.sha256()
    for p in sorted(Path(cfg.lib_path).rglob("*.py")): h.update(p.name.encode()); h.update(p.read_bytes())
    h.update(BUILD_VERSION.encode()); h.update(sys.version.encode())    # the notebook's processed text is hashed beside it
    return h.hexdigest()

# ------------------------------------------------------------------------------ 2. execution

KERNEL = "pagednb-docs"

def _kernelspec(build: Path) -> Path:
    "A kernelspec that runs this very interpreter (the venv's), found through JUPYTER_PATH."
    d = build/"jupyter"/"kernels"/KERNEL
    spec = dict(argv=[sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}",
                      "--IPKernelApp.log_level=ERROR"],          # not the "TCP without encryption" notice; it is loopback
                display_name="pagednb docs (this venv)", language="python", metadata={"debugger": False})
    text = json.dumps(spec, indent=1)
    if not (d/"kernel.json").exists() or (d/"kernel.json").read_text(encoding="utf-8") != text:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d/f"kernel.json.{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, d/"kernel.json")          # atomic: notebooks executed by parallel builds share it
    return build/"jupyter"

def _polling(get_msg, every=0.5):
    """`get_msg(timeout)` as a loop of short waits. A kernel client's blocking wait on the shell channel can hold a
    reply that has already arrived until its whole timeout runs out (nbclient issue 312, seen with widgets), which
    turned a 4 s notebook into a 600 s one; short waits pick the reply up within `every` seconds."""
    from queue import Empty
    from nbclient.util import ensure_async
    async def get(timeout=None, **kw):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = every if deadline is None else max(0.0, deadline - time.monotonic())
            try: return await ensure_async(get_msg(timeout=min(every, left), **kw))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline: raise
    return get

def _client_class():
    "nbclient's `NotebookClient`, its shell and IOPub channels read by `_polling`."
    from nbclient import NotebookClient
    class PollingClient(NotebookClient):
        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            for channel in (kc.shell_channel, kc.iopub_channel): channel.get_msg = _polling(channel.get_msg)
            return kc
    return PollingClient

def _execute(job):
    "Run one notebook (in a worker process); returns (name, executed json or None, error text or None, seconds)."
    name, nb_json, cwd, timeout = job
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    nb = nbformat.reads(nb_json, as_version=4)
    t0 = time.time()
    try:
        _client_class()(nb, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": cwd}},
                       allow_errors=False, record_timing=False).execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        return name, None, str(e), time.time() - t0
    return name, nbformat.writes(nb), None, time.time() - t0

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

def _executed(jobs, n_workers):
    "Each job's `_execute` result as it finishes: in this process for one at a time, else in worker processes."
    if n_workers == 1:
        yield from map(_execute, jobs)
        return
    import multiprocessing as mp
    with ProcessPoolExecutor(max_workers=max(1, min(n_workers, len(jobs))), mp_context=mp.get_context("spawn")) as ex:
        for fut in as_completed([ex.submit(_execute, j) for j in jobs]): yield fut.result()

def execute_all(jobs, n_workers, on_done):
    """Execute the (name, nb json, cwd, timeout) jobs, `n_workers` at a time, passing each clean run to `on_done`;
    then raise naming every notebook that failed."""
    errors = []
    if not jobs: return
    for name, out, err, secs in _executed(jobs, n_workers):
        _log(f"executed {name} in {secs:.0f} s" + (" -- FAILED" if err else ""))
        if err: errors.append(f"--- {name}:\n" + _ANSI.sub("", err)[-4000:])
        else: on_done(name, out)
    if errors: raise BuildError("notebooks failed to execute (the docs show only clean runs):\n" + "\n".join(errors))

# ------------------------------------------------------------------------------ 3. after execution

_SKIP_PROCS = {"FrontmatterProc", "add_show_docs", "insert_warning", "clean_show_doc", "exec_show_docs"}
# How the Quarto cell options that nbdev leaves in code cells map onto myst-nb cell tags.
_QUARTO_TAGS = {("echo", "false"): "remove-input", ("output", "false"): "remove-output", ("include", "false"): "remove-cell",
                ("code-fold", "true"): "hide-input", ("code-fold", ""): "hide-input"}
COLAB_IMG = re.compile(r"https?://colab\.research\.google\.com/assets/colab-badge\.svg")
COLAB_LINK = re.compile(r"https?://colab\.research\.google\.com/github/[^\s)\"'>]+")

class Site:
    "What the page rewriting needs to know about the whole site."
    def __init__(self, cfg, nbs: Path, pages: dict):
        self.cfg, self.nbs, self.pages = cfg, nbs, pages          # pages: notebook stem -> page name
        self.doc_url = (str(cfg.get("doc_host", "")).rstrip("/") + "/" + str(cfg.get("doc_baseurl", "")).strip("/")).rstrip("/")
        m = re.match(r"https?://github\.com/([^/]+/[^/]+?)(?:\.git)?/?$", str(cfg.get("git_url", "")))
        self.gh_repo = m.group(1) if m else None
        self.branch = cfg.get("branch", "main")
        try: self.nbs_rel = nbs.resolve().relative_to(ROOT).as_posix()
        except ValueError: self.nbs_rel = "nbs"

    def colab_url(self, nb_name):
        return f"https://colab.research.google.com/github/{self.gh_repo}/blob/{self.branch}/{self.nbs_rel}/{nb_name}"

    def repo_links(self, md: str, base: str, prefix="") -> str:
        """Relative markdown links of a file in folder `base` of the repository (`nbs`, or `` for the README), made to
        work from the site: a notebook -> its lesson page, any other file -> the file on GitHub."""
        def sub(m):
            label, target = m.group(1), m.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target): return m.group(0)
            path, _, frag = target.partition("#")
            path = posixpath.normpath(posixpath.join(base, path))
            stem = posixpath.basename(path)[:-len(".ipynb")] if path.endswith(".ipynb") else None
            if stem in self.pages and posixpath.dirname(path) == self.nbs_rel:
                return f"[{label}]({prefix}{self.pages[stem]}.ipynb{'#' + frag if frag else ''})"
            if self.gh_repo and not path.startswith(".."):
                return f"[{label}](https://github.com/{self.gh_repo}/blob/{self.branch}/{path}{'#' + frag if frag else ''})"
            return label
        return re.sub(r"(?<!!)\[([^\[\]\n]+)\]\(([^)\s]+)\)", sub, md)

    def lesson_names(self, md: str, prefix="") -> str:
        "A notebook named in code (`` `02_block_manager` ``, outside code blocks) links to its lesson."
        parts = re.split(r"(^```.*?^```)", md, flags=re.S | re.M)
        sub = lambda m: f"[`{m.group(1)}`]({prefix}{self.pages[m.group(1)]}.ipynb)" if m.group(1) in self.pages else m.group(0)
        return "".join(p if i % 2 else re.sub(r"(?<![\[`])`(\w+)(?:\.ipynb)?`(?![`\]])", sub, p) for i, p in enumerate(parts))

    def local_links(self, md: str, prefix="") -> str:
        "nbdev links to the published site (`[`x`](https://host/base/kv_cache.html#x)`) -> links into this site."
        if not self.doc_url: return md
        pat = re.compile(r"\[([^\]\n]+)\]\(" + re.escape(self.doc_url) + r"/([\w.-]+?)\.html(#[^)\s]*)?\)")
        def sub(m):
            text, page, anchor = m.group(1), m.group(2), m.group(3) or ""
            if re.search(r"(^#|\.)_", anchor): return text      # a private name: nbdev indexes it, but nothing documents it
            code = re.fullmatch(r"`([^`]+)`", text)
            inner = (f'<code class="docutils literal notranslate"><span class="pre">{html.escape(code.group(1))}</span></code>'
                     if code else html.escape(text))
            return f'<a class="reference internal nbdev-link" href="{prefix}{page}.html{anchor}">{inner}</a>'
        return pat.sub(sub, md)

def _md_text(out):
    d = out.get("data", {}).get("text/markdown")
    return ("".join(d) if isinstance(d, list) else d) if d is not None else None

def _with_line(url: str, name: str) -> str:
    "nbdev's source links lack the line (`#LNone`): find it, for `name` in the module file `url` points at."
    m = re.search(r"/blob/[^/]+/(.+?\.py)$", url)
    if not m or not name: return url
    try:
        import inspect
        mod = importlib.import_module(m.group(1)[:-3].replace("/", "."))
        obj = mod
        for part in name.split("."): obj = getattr(obj, part)
        obj = inspect.unwrap(getattr(obj, "fget", obj))
        return f"{url}#L{inspect.getsourcelines(obj)[1]}"
    except Exception: return url

def showdoc_markdown(md: str, level: int, site: Site, prefix="") -> str:
    "nbdev's show_doc markdown, made plain MyST: heading at `level` with nbdev's anchor, no rules, a small source link."
    md = re.sub(r"^\s*---\s*$", "", md, flags=re.M)
    heading = re.search(r"^#{1,6}\s+(.+?)\s*$", md, flags=re.M)
    def src(m):
        url = m.group(1)
        if "#L" not in url or url.endswith("#LNone"): url = _with_line(url.replace("#LNone", ""), heading.group(1).strip("` ") if heading else "")
        return f'<a class="nbdev-source" href="{html.escape(url)}" target="_blank" rel="noopener">source</a>'
    md = re.sub(r"\[source\]\((\S+?)\)(\{[^}\n]*\})?", src, md)
    m = re.search(r"^(#{1,6})\s+(.+?)\s*$", md, flags=re.M)
    if m:
        name = m.group(2).strip("` ")
        anchor = f'<div class="nbdev-anchor" id="{html.escape(name.lower())}"></div>\n\n'
        md = md[:m.start()] + anchor + "#"*level + " " + m.group(2) + md[m.end():]
        # the source link goes right under the heading, floated right
        s = re.search(r'^<a class="nbdev-source".*$\n?', md, flags=re.M)
        if s and s.start() < m.start() + len(anchor):
            link = s.group(0).strip(); md = md[:s.start()] + md[s.end():]
            md = md.replace("#"*level + " " + m.group(2), "#"*level + " " + m.group(2) + "\n\n" + link, 1)
    md = re.sub(r"\n{3,}", "\n\n", md).strip()
    # a docstring's relative links (an inherited pydantic docstring has some) lead nowhere on this site: keep the text
    md = re.sub(r"(?<!!)\[([^\[\]\n]+)\]\((?![a-z][a-z0-9+.-]*:|#)[^)\s]*\)", r"\1", md)
    return site.local_links(md, prefix) + "\n"

def _plotly_html(fig: dict) -> str:
    "A plotly JSON figure as a div + Plotly.newPlot call that uses the page's own plotly.js (no CDN)."
    import plotly.io as pio
    fig = dict(fig); config = dict(fig.pop("config", None) or {})
    config.setdefault("responsive", True); config.setdefault("displaylogo", False)
    out = pio.to_html(fig, include_plotlyjs=False, full_html=False, auto_play=False, config=config,
                      default_width="100%", default_height="450px", validate=False)
    return _after_plotly(out)

_NEWPLOT = re.compile(r'(<script(?: type="text/javascript")?>)((?:(?!</script>).)*?Plotly\.newPlot(?:(?!</script>).)*?)(</script>)', re.S)

def _after_plotly(html_: str) -> str:
    "The theme loads scripts (plotly.js among them) at the end of the page: each inline Plotly.newPlot waits for them."
    wrap = lambda m: (m.group(1) + '(function draw() { if (!window.Plotly) { document.addEventListener("DOMContentLoaded", draw, {once: true}); return; }\n'
                      + m.group(2) + '\n})();' + m.group(3))
    return _NEWPLOT.sub(wrap, html_)

_WVIEW = "application/vnd.jupyter.widget-view+json"

def _fix_outputs(cell, site: Site):
    for o in cell.get("outputs", []):
        data = o.get("data")
        if not data: continue
        if "application/vnd.plotly.v1+json" in data:
            html_ = _plotly_html(data["application/vnd.plotly.v1+json"])
            data.clear(); data["text/html"] = html_
        elif _WVIEW in data and "text/html" in data:
            # a widget that carries a kernel-free copy of itself (EngineStepper's `to_html`): the site has no kernel to
            # answer the widget's buttons, so the page shows the copy, whose controls run in the browser
            h = data["text/html"]
            html_ = _after_plotly("".join(h) if isinstance(h, list) else h)
            data.clear(); data["text/html"] = html_
        md = _md_text(o)
        if md is not None: data["text/markdown"] = site.local_links(md)

def postprocess(executed, nb_path: Path, site: Site):
    "The executed notebook as a page: nbdev's doc processors, show_doc output as markdown, tags, badge, local links."
    import nbformat
    from fastcore.nbio import dict2nb, nb2str, mk_cell
    from nbdev.process import NBProcessor
    from nbdev.processors import FilterDefaults
    nb = dict2nb(json.loads(nbformat.writes(executed)))
    nb["path_"] = str(nb_path)
    for c in nb.cells:
        if c.get("metadata", {}).get("pagednb_docs") == "show_doc": c["has_sd"] = True       # for nbdev's mv_exports
    procs = [p for p in FilterDefaults().procs() if getattr(p, "__name__", type(p).__name__) not in _SKIP_PROCS]
    NBProcessor(nb=nb, procs=procs, rm_directives="quarto").process()
    cells, level = [], 1
    for c in nb.cells:
        c.pop("has_sd", None)
        kind = c.get("metadata", {}).pop("pagednb_docs", None)
        if c.cell_type == "markdown":
            c.source = site.lesson_names(site.local_links(site.repo_links(COLAB_IMG.sub("_static/colab-badge.svg", c.source), site.nbs_rel)))
            hs = re.findall(r"^(#{1,6})\s", re.sub(r"```.*?```", "", c.source, flags=re.S), flags=re.M)
            if hs: level = len(hs[-1])
        elif c.cell_type == "code":
            if kind == "show_doc":
                md = next((m for m in map(_md_text, c.get("outputs", [])) if m), None)
                if md is None:
                    raise BuildError(f"{nb_path.name}: `{c.source.strip()}` printed no API docs; its outputs: {c.get('outputs')}")
                c = mk_cell(showdoc_markdown(md, min(level + 1, 6), site), "markdown")
            else:
                tags = list(c.metadata.get("tags", []))
                for k, v in c.directives.items():
                    t = _QUARTO_TAGS.get((k, str(v).lower()))
                    if t and t not in tags: tags.append(t)
                c.remove_directives()
                if tags: c.metadata["tags"] = tags
                if not c.source.strip() and not c.get("outputs"): continue
                _fix_outputs(c, site)
        cells.append(c)
    nb.cells = cells
    # every lesson carries an "Open in Colab" badge, pointing at this very notebook
    badge = f"[![Open In Colab](_static/colab-badge.svg)]({site.colab_url(nb_path.name)})"
    has = False
    for c in nb.cells:
        if c.cell_type == "markdown" and COLAB_LINK.search(c.source):
            c.source = COLAB_LINK.sub(site.colab_url(nb_path.name), c.source); has = True
    if not has and site.gh_repo:
        i = next((i + 1 for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and re.search(r"^#\s", c.source, flags=re.M)), 0)
        nb.cells.insert(i, mk_cell(badge, "markdown"))
    if not _has_widget_views(nb): nb.metadata.pop("widgets", None)     # no view left on the page: no widget manager
    else: _static_figure_widgets(nb.metadata)
    return nbformat.reads(nb2str(nb), as_version=4)

_WSTATE = "application/vnd.jupyter.widget-state+json"

def _static_figure_widgets(meta):
    """Saved plotly `FigureWidget`s (anywidget models carrying plotly's 5 MB JavaScript bundle each, which the offline
    widget manager cannot load) become HTML widgets holding the figure; the site's pagednb.js draws them with
    plotly.js. Everything else in the saved widget state is left as it is."""
    state = ((meta.get("widgets") or {}).get(_WSTATE) or {}).get("state") or {}
    for mid, m in list(state.items()):
        st = m.get("state") or {}
        if m.get("model_module") != "anywidget" or "_widget_data" not in st: continue
        fig = dict(data=st.get("_widget_data") or [], layout=st.get("_widget_layout") or {},
                   config=dict(st.get("_config") or {}, responsive=True, displaylogo=False))
        h = (fig["layout"] or {}).get("height") or 450
        value = (f'<div class="plotly-graph-div pagednb-figurewidget" style="width:100%; height:{int(h)}px" '
                 f'data-figure="{html.escape(json.dumps(fig), quote=True)}"></div>')
        ctl, ver = "@jupyter-widgets/controls", "2.0.0"
        state[mid + "-layout"] = dict(model_module="@jupyter-widgets/base", model_module_version=ver, model_name="LayoutModel",
                                      state=dict(_model_module="@jupyter-widgets/base", _model_module_version=ver, _model_name="LayoutModel",
                                                 _view_module="@jupyter-widgets/base", _view_module_version=ver, _view_name="LayoutView",
                                                 width="100%"))
        state[mid + "-style"] = dict(model_module=ctl, model_module_version=ver, model_name="HTMLStyleModel",
                                     state=dict(_model_module=ctl, _model_module_version=ver, _model_name="HTMLStyleModel",
                                                _view_module="@jupyter-widgets/base", _view_module_version=ver, _view_name="StyleView"))
        state[mid] = dict(model_module=ctl, model_module_version=ver, model_name="HTMLModel",
                          state=dict(_model_module=ctl, _model_module_version=ver, _model_name="HTMLModel", _view_module=ctl,
                                     _view_module_version=ver, _view_name="HTMLView", _dom_classes=[], description="",
                                     layout=f"IPY_MODEL_{mid}-layout", style=f"IPY_MODEL_{mid}-style", placeholder="", value=value))

def _has_widget_views(nb):
    return any("application/vnd.jupyter.widget-view+json" in (o.get("data") or {}) for c in nb.cells for o in c.get("outputs", []))

# ------------------------------------------------------------------------------ API reference pages

def _modidx(cfg):
    try: return importlib.import_module(f"{cfg.lib_name}._modidx").d.get("syms", {})
    except Exception: return {}

def _first_para(doc):
    doc = (doc or "").strip()
    doc = re.split(r"\n\s*\n", doc)[0] if doc else ""
    return "" if doc.startswith("Docs:") else " ".join(doc.split())

def _obj_markdown(obj, qualname: str, level: int, site: Site) -> str:
    "API docs of one object: nbdev's show_doc where it can, a plain signature + docstring otherwise."
    import inspect, reprlib
    if not (callable(obj) or isinstance(obj, property)):
        r = reprlib.Repr(); r.maxstring = r.maxother = 100; r.maxdict = r.maxlist = 8
        short = qualname.split(".")[-1]
        return (f'<div class="nbdev-anchor" id="{html.escape(qualname.lower())}"></div>\n\n{"#"*level} {short}\n\n'
                f"```python\n{short} = {r.repr(obj)}\n```\n")
    try:
        from nbdev.showdoc import show_doc
        md = show_doc(obj, name=qualname, title_level=level)._repr_markdown_()
        return showdoc_markdown(md, level, site, prefix="../")
    except Exception:
        doc = inspect.getdoc(obj) or ""
        return f"{'#'*level} {qualname}\n\n{doc}\n"

def api_pages(cfg, site: Site, lesson_of: dict):
    "One markdown page per module of the package, generated from nbdev's symbol index (`_modidx`), in index order."
    lib = cfg.lib_name
    syms = _modidx(cfg)
    mods = [m.name for m in pkgutil.iter_modules([str(cfg.lib_path)]) if not m.name.startswith("_")]
    pages, index_rows = {}, []
    for name in sorted(mods):
        full = f"{lib}.{name}"
        try: mod = importlib.import_module(full)
        except Exception as e: raise BuildError(f"API reference: cannot import {full}: {type(e).__name__}: {e}") from e
        desc = _first_para(mod.__doc__)
        parts = [f"# {full}\n"]
        if desc: parts.append(f"{desc}\n")
        if name in lesson_of: parts.append(f"Explained in the lesson [{lesson_of[name][1]}](../{lesson_of[name][0]}.ipynb).\n")
        if full in syms: keys = [k[len(full) + 1:] for k in syms[full]]
        else: keys = list(getattr(mod, "__all__", [n for n, o in vars(mod).items() if getattr(o, "__module__", None) == full]))
        keys = [k for k in keys if not any(p.startswith("_") and p not in ("__call__",) for p in k.split("."))]
        tops = [k for k in keys if "." not in k]
        for k in tops:
            obj = getattr(mod, k, None)
            if obj is None and not hasattr(mod, k): continue
            parts.append(_obj_markdown(obj, k, 2, site))
            for member in [m for m in keys if m.startswith(k + ".") and m.count(".") == 1]:
                mname = member.split(".")[1]
                try: mobj = getattr(obj, mname)
                except AttributeError: continue
                if mname.startswith("__") and getattr(mobj, "__doc__", None) == getattr(getattr(object, mname, None) or type, "__doc__", None): continue
                if mname.startswith("__") and not (getattr(mobj, "__doc__", None) or "").strip(): continue
                parts.append(_obj_markdown(mobj, member, 3, site))
        pages[name] = "\n".join(parts)
        index_rows.append((name, full, desc))
    return pages, index_rows

# ------------------------------------------------------------------------------ the landing page

def readme_markdown(site: Site) -> str:
    "README.md with its links into the repository made to work from the site."
    return site.lesson_names(site.repo_links((ROOT/"README.md").read_text(encoding="utf-8"), ""))

def course_markdown(site: Site) -> str:
    "COURSE.md (the course map: paths, times, agendas, instructor notes) as a page of the site."
    return site.lesson_names(site.repo_links((ROOT/"COURSE.md").read_text(encoding="utf-8"), ""))

def index_markdown(lessons, api_rows) -> str:
    lines = ["```{include} _includes/README.md\n```\n",
             "```{toctree}\n:caption: Course\n:maxdepth: 1\n\ncourse\n```\n",
             "```{toctree}\n:caption: Lessons\n:maxdepth: 1\n"] + [f"{p}\n" for p in lessons] + ["```\n",
             "```{toctree}\n:caption: Reference\n:maxdepth: 1\n\napi/index\n```\n"]
    return "\n".join(lines)

def api_index_markdown(api_rows) -> str:
    rows = "\n".join(f"| [`{full}`]({name}.md) | {desc} |" for name, full, desc in api_rows)
    toc = "\n".join(name for name, _, _ in api_rows)
    return (f"# API reference\n\nEvery module of the package, with the documentation of what it exports. "
            f"The lessons explain why each piece is the way it is.\n\n| module | what it holds |\n|---|---|\n{rows}\n\n"
            f"```{{toctree}}\n:hidden:\n:maxdepth: 1\n\n{toc}\n```\n")

# ------------------------------------------------------------------------------ 4. the offline check

_RES_ATTR = re.compile(r"<(script|link|img|iframe|source|audio|video|embed|object|image|use)\b([^>]*)>", re.I)
_URL_ATTR = re.compile(r"""\b(src|href|data|srcset|poster|xlink:href)\s*=\s*["']?\s*((?:https?:)?//[^"'\s>]+)""", re.I)
_CSS_URL = re.compile(r"""(?:url\(\s*["']?|@import\s+["'])\s*((?:https?:)?//[^"')\s]+)""", re.I)

def check_offline(html_dir) -> list:
    """Every place where the built site would fetch something from outside itself: (file, url).
    Links (`<a href>`) may point anywhere: they are followed only when clicked. What a page *loads* may not:
    scripts, stylesheets, fonts, images, frames, media, and url()/@import in CSS and in style attributes."""
    html_dir = Path(html_dir); bad = []
    for f in sorted(html_dir.rglob("*")):
        if f.suffix not in (".html", ".css", ".svg") or not f.is_file(): continue
        text = f.read_text(encoding="utf-8", errors="replace")
        rel = f.relative_to(html_dir).as_posix()
        bad += [(rel, u) for u in _CSS_URL.findall(text)]
        if f.suffix == ".css": continue
        for tag, attrs in _RES_ATTR.findall(text):
            if tag.lower() == "link" and not re.search(r"""rel\s*=\s*["']?[^"'>]*(stylesheet|icon|preload|prefetch|modulepreload|manifest)""", attrs, re.I):
                continue
            bad += [(rel, u) for a, u in _URL_ATTR.findall(attrs) if not (tag.lower() in ("svg",) and a.lower() == "xmlns")]
        bad += [(rel, u) for u in re.findall(r"""\bimport\s*\(\s*["']((?:https?:)?//[^"']+)""", text)]
    return sorted(set(bad))

# ------------------------------------------------------------------------------ the build

def build(force=False, only=(), nbs=None, out=None, build_dir=None, jobs=None, strict=True, reuse=False, cell_timeout=None,
          execute_only=False):
    t_start = time.time()
    os.chdir(ROOT)                                      # nbdev's processors read the project's config from the cwd
    cfg = _cfg()
    nbs = Path(nbs or cfg.nbs_path).resolve()
    build = Path(build_dir or DOCS/"_build").resolve()
    out = Path(out or build/"html").resolve()
    src, cache = build/"src", build/"exec"
    nb_paths = notebooks(nbs, only)
    if not nb_paths: raise BuildError(f"no notebooks to build in {nbs}" + (f" matching {only}" if only else ""))
    pages = {p.stem: page_name(p) for p in nb_paths}
    site = Site(cfg, nbs, pages)
    timings = {}

    # 1 + 2: process and execute (or reuse the last run of an unchanged notebook)
    t0 = time.time()
    fp = _package_fingerprint(cfg)
    jobs_, pre = [], {}
    import nbformat
    for p in nb_paths:
        nb = preprocess(p, cfg)
        text = nbformat.writes(nb)
        nb_key = hashlib.sha256(text.encode()).hexdigest()
        key = hashlib.sha256((nb_key + fp).encode()).hexdigest()
        pre[p.stem] = dict(key=key, nb_key=nb_key)
        cached = cache/f"{p.stem}.ipynb"
        if not force and cached.exists():
            try:
                k = nbformat.read(cached, as_version=4).metadata.get("pagednb_docs", {})
                if k.get("key") == key or (reuse and k.get("nb_key") == nb_key): continue
            except Exception: pass
        jobs_.append((p.stem, text, str(nbs), int(cell_timeout or cfg.get("cell_timeout", 600) or 600)))
    timings["process"] = time.time() - t0
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(_kernelspec(build))] + [x for x in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if x])
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    n_workers = jobs or min(2, os.cpu_count() or 1)            # as bootstrap.py's nbdev-test --n-workers 2
    for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):           # and, as there, one BLAS pool per core, not a fight
        os.environ.setdefault(v, str(max(1, (os.cpu_count() or 1)//n_workers)))
    t0 = time.time()
    _log(f"{len(nb_paths)} notebooks; executing {len(jobs_)} ({len(nb_paths) - len(jobs_)} unchanged since their last run)")
    def keep_run(name, text):
        nb = nbformat.reads(text, as_version=4)
        nb.metadata["pagednb_docs"] = pre[name]
        cache.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, cache/f"{name}.ipynb")
    execute_all(jobs_, n_workers, keep_run)
    timings["execute"] = time.time() - t0
    if execute_only: return dict(executed=[j[0] for j in jobs_], timings=timings)

    # 3: the Sphinx source tree
    t0 = time.time()
    keep = set()
    lessons = []
    for p in nb_paths:
        executed = nbformat.read(cache/f"{p.stem}.ipynb", as_version=4)
        executed.metadata.pop("pagednb_docs", None)
        page = postprocess(executed, p, site)
        page.metadata["kernelspec"] = dict(name="python3", display_name="Python 3", language="python")
        _write(src/f"{pages[p.stem]}.ipynb", nbformat.writes(page)); keep.add(f"{pages[p.stem]}.ipynb")
        lessons.append(pages[p.stem])
    lesson_of = {}
    for p in nb_paths:
        mod = default_exp(p)
        if mod: lesson_of.setdefault(mod, (pages[p.stem], nb_title(p) or pages[p.stem]))
    sys.path.insert(0, str(ROOT))
    api, api_rows = api_pages(cfg, site, lesson_of)
    for name, text in api.items(): _write(src/"api"/f"{name}.md", text); keep.add(f"api/{name}.md")
    _write(src/"api"/"index.md", api_index_markdown(api_rows)); keep.add("api/index.md")
    _write(src/"_includes"/"README.md", readme_markdown(site))
    _write(src/"course.md", course_markdown(site)); keep.add("course.md")
    _write(src/"index.md", index_markdown(lessons, api_rows)); keep.add("index.md")
    (src/"_static").mkdir(parents=True, exist_ok=True)
    shutil.copy2(DOCS/"_static"/"colab-badge.svg", src/"_static"/"colab-badge.svg")
    for f in list(src.rglob("*.ipynb")) + list(src.rglob("*.md")):   # pages of notebooks or modules that are gone
        rel = f.relative_to(src).as_posix()
        if rel not in keep and not rel.startswith("_includes/"): f.unlink()
    timings["pages"] = time.time() - t0

    # 4: Sphinx
    t0 = time.time()
    warnings = build/"sphinx-warnings.txt"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(DOCS), "-d", str(build/"doctrees"),
           str(src), str(out), "-q", "-w", str(warnings), "--keep-going"]
    if strict: cmd.append("-W")
    env = dict(os.environ, PAGEDNB_DOCS_BUILD=str(build))
    r = subprocess.run(cmd, env=env)
    timings["sphinx"] = time.time() - t0
    warn_text = warnings.read_text(encoding="utf-8").strip() if warnings.exists() else ""
    if r.returncode:
        raise BuildError(f"Sphinx failed (exit {r.returncode}); warnings count as errors here:\n{warn_text}")
    bad = check_offline(out)
    if bad:
        raise BuildError("the site would load these from outside itself (it must work offline):\n" +
                         "\n".join(f"  {f}: {u}" for f, u in bad[:50]))
    n_pages = len(list(out.rglob("*.html")))
    timings["total"] = time.time() - t_start
    _log(f"built {out/'index.html'}: {len(lessons)} lessons, {len(api_rows)} API pages, {n_pages} HTML pages in all; " +
         ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    return dict(out=out, lessons=lessons, api=[r[0] for r in api_rows], n_html=n_pages, timings=timings, warnings=warn_text)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("only", nargs="*", help="build only the notebooks whose file names contain one of these")
    ap.add_argument("--force", action="store_true", help="re-execute every notebook even if its last run is still valid")
    ap.add_argument("--reuse", action="store_true", help="reuse the last run of a notebook whose own text is unchanged, "
                    "even if the package changed since (quick layout checks; outputs may be stale)")
    ap.add_argument("--nbs", help="notebook folder (default: nbdev's nbs_path)")
    ap.add_argument("--out", help="output folder (default: docs/_build/html)")
    ap.add_argument("--build-dir", help="work folder (default: docs/_build)")
    ap.add_argument("--jobs", type=int, help="notebooks executed at once (default: 2, or 1 on one core)")
    ap.add_argument("--cell-timeout", type=int, help="seconds a cell may run (default: nbdev's cell_timeout, 600)")
    ap.add_argument("--no-strict", action="store_true", help="let Sphinx warnings pass (they are still listed)")
    ap.add_argument("--execute-only", action="store_true", help="only execute the notebooks (a failing cell fails), "
                    "keeping each clean run for the next build; no pages (python3 bootstrap.py test runs each lesson so)")
    a = ap.parse_args(argv)
    try: build(a.force, a.only, a.nbs, a.out, a.build_dir, a.jobs, strict=not a.no_strict, reuse=a.reuse, cell_timeout=a.cell_timeout,
                 execute_only=a.execute_only)
    except BuildError as e:
        print(f"\n[docs] BUILD FAILED: {e}", file=sys.stderr, flush=True); return 1
    return 0

if __name__ == "__main__": sys.exit(main())
