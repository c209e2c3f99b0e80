"""Sphinx configuration of the pagednb docs site.

Build the site with `python docs/build.py` (it prepares the pages in docs/_build/src, then runs Sphinx with
this file as `sphinx-build -c docs`). Everything a page loads is served from the site itself: the theme
(furo), plotly.js (copied from the installed plotly), MathJax 3 (from the `django-static-mathjax` wheel, plain
static files) and the ipywidgets HTML manager (vendored in _static/vendor/html-manager).
"""
import importlib.util, os, re, shutil
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
BUILD = Path(os.environ.get("PAGEDNB_DOCS_BUILD", DOCS/"_build"))

def _version():
    m = re.search(r"""__version__\s*=\s*["']([^"']+)""", (ROOT/"pagednb"/"__init__.py").read_text(encoding="utf-8"))
    return m.group(1) if m else "0"

project = "pagednb"
author = "pagednb developers"
copyright = "pagednb developers"
version = release = _version()

extensions = ["myst_nb"]
exclude_patterns = ["_includes", "**.ipynb_checkpoints", "_static"]
root_doc = "index"
language = "en"
nitpicky = False

# ---- MyST (markdown cells, README, API pages) and myst-nb (notebooks, executed by docs/build.py beforehand)
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "html_image", "strikethrough", "tasklist"]
myst_heading_anchors = 3
nb_execution_mode = "off"                 # build.py executed the notebooks, with nbdev-test's skip rules
nb_merge_streams = True
nb_output_stderr = "show"
nb_render_markdown_format = "myst"
# the ipywidgets HTML manager from the site itself, not myst-nb's CDN default (require.js + jsdelivr)
nb_ipywidgets_js = {"vendor/html-manager/embed.js": {}}

# ---- HTML
html_theme = "furo"
html_title = f"pagednb {release}"
html_static_path = ["_static", str(BUILD/"static")]
html_css_files = ["pagednb.css"]
html_js_files = [("pagednb.js", {"priority": 100})]          # before the widget manager (myst-nb adds it at 500)
html_copy_source = False
html_show_sourcelink = False
html_theme_options = {"navigation_with_keys": True}
mathjax_path = "mathjax/tex-svg-full.js"        # MathJax 3, all TeX extensions in one file: nothing loaded later

def _copy_if_changed(src: Path, dst: Path):
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists() or dst.stat().st_size != src.stat().st_size or dst.stat().st_mtime < src.stat().st_mtime:
        shutil.copy2(src, dst)

def _served_assets():
    "plotly.js and MathJax, copied from their installed packages into the site's _static (docs/_build/static)."
    import plotly
    _copy_if_changed(Path(plotly.__file__).parent/"package_data"/"plotly.min.js", BUILD/"static"/"plotly.min.js")
    spec = importlib.util.find_spec("mathjax")
    mj = Path(next(iter(spec.submodule_search_locations)))/"static"/"mathjax" if spec and spec.submodule_search_locations else None
    if mj is None or not (mj/"es5"/"tex-svg-full.js").exists():
        raise RuntimeError("MathJax for the offline docs is missing: pip install django-static-mathjax (plain static files, no Django)")
    _copy_if_changed(mj/"es5"/"tex-svg-full.js", BUILD/"static"/"mathjax"/"tex-svg-full.js")
    _copy_if_changed(mj/"LICENSE", BUILD/"static"/"mathjax"/"LICENSE")

_served_assets()

def _plotly_on_pages_with_figures(app, pagename, templatename, context, doctree):
    "Load plotly.js (from _static) on the pages that draw a figure, before the figures' own inline scripts run."
    body = context.get("body", "")
    # saved FigureWidgets live in the page's widget state, which myst-nb adds as an inline script, not in the body
    inline = " ".join(str(getattr(js, "attributes", {}).get("body", "")) for js in context.get("script_files", []))
    if "plotly-graph-div" in body or "pagednb-figurewidget" in inline:
        app.add_js_file("plotly.min.js", priority=200)

def setup(app):
    app.connect("html-page-context", _plotly_on_pages_with_figures)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
