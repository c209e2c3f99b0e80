"""Helpers for tests/test_jupyterlab.py: a real JupyterLab server on a loopback port over copies of some notebooks
(a temporary root, a token, a kernel of this very interpreter), and headless Debian chromium driving it through
Playwright with every request off that server blocked (the browser set-up of tests/docs_browser.py)."""
import contextlib, json, os, secrets, shutil, socket, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
from docs_browser import CHROMIUM, CHROMIUM_ARGS

KERNEL = "pagednb-lab-test"

def no_chromium():
    "Why chromium cannot drive the test here, or None."
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        return f"{CHROMIUM} is missing and could not be installed (apt-get install -y chromium, as root; bootstrap.py test tries)"

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def _settings(d: Path):
    "JupyterLab user settings: every cell in the DOM (no windowing), no news or update checks (no network here)."
    put = lambda rel, obj: (d/rel).parent.mkdir(parents=True, exist_ok=True) or (d/rel).write_text(json.dumps(obj))
    put("@jupyterlab/notebook-extension/tracker.jupyterlab-settings", {"windowingMode": "none"})
    put("@jupyterlab/apputils-extension/notification.jupyterlab-settings", {"fetchNews": "false", "checkForUpdates": False})

class JupyterLab:
    "`jupyter lab` over copies of `notebooks` (their kernel: this interpreter); `url(path)` with the token; a log file."
    def __init__(self, notebooks, timeout=90):
        self.notebooks, self.timeout = [Path(p) for p in notebooks], timeout

    def __enter__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="pagednb-lab-"))
        self.root = self.tmp/"root"
        self.root.mkdir()
        for p in self.notebooks:                      # copies: the sources are never touched, and they name our kernel
            nb = json.loads(p.read_text(encoding="utf-8"))
            nb.setdefault("metadata", {})["kernelspec"] = dict(name=KERNEL, display_name="pagednb (test)", language="python")
            (self.root/p.name).write_text(json.dumps(nb), encoding="utf-8")
        spec = dict(argv=[sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    display_name="pagednb (test)", language="python", metadata={"debugger": False})
        (self.tmp/"data"/"kernels"/KERNEL).mkdir(parents=True)
        (self.tmp/"data"/"kernels"/KERNEL/"kernel.json").write_text(json.dumps(spec))
        _settings(self.tmp/"settings")
        env = dict(os.environ, JUPYTER_PATH=str(self.tmp/"data"), JUPYTER_CONFIG_DIR=str(self.tmp/"config"),
                   JUPYTER_RUNTIME_DIR=str(self.tmp/"runtime"), JUPYTERLAB_SETTINGS_DIR=str(self.tmp/"settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.tmp/"workspaces"), IPYTHONDIR=str(self.tmp/"ipython"),
                   PYDEVD_DISABLE_FILE_VALIDATION="1")
        env.setdefault("TRITON_INTERPRET", "1")
        env.pop("JUPYTER_TOKEN", None)
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}/"
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly", "--LabApp.news_url=",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--KernelSpecManager.ensure_native_kernel=False",
               "--ServerApp.terminals_enabled=False"]
        if hasattr(os, "geteuid") and os.geteuid() == 0: cmd.append("--allow-root")      # CI and these machines run as root
        self.log = self.tmp/"server.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None: raise RuntimeError(f"jupyter lab exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=5) as r:
                    if r.status == 200: break
            except OSError: pass
            if time.time() - t0 > self.timeout: raise RuntimeError(f"jupyter lab did not answer in {self.timeout} s:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def url(self, path=""):
        return f"{self.base}{path}{'&' if '?' in path else '?'}token={self.token}"

    def log_tail(self, n=4000):
        try: return self.log.read_text(errors="replace")[-n:]
        except OSError: return ""

    def kernels(self) -> list:
        "The kernels the server runs now (its REST API)."
        with urllib.request.urlopen(self.url("api/kernels"), timeout=10) as r: return json.loads(r.read())

    def __exit__(self, *a):
        self.proc.terminate()
        try: self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill(); self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

# ------------------------------------------------------------------------------ the browser, in JupyterLab

# The notebook panel of `path`, from the app that `--LabApp.expose_app_in_browser` puts on window.
_PANEL = """(path) => { const app = window.jupyterapp; if (!app) return null;
    return Array.from(app.shell.widgets('main')).find(w => w.context && w.context.path === path && w.content) || null; }"""

_READY = """(path) => { const p = (%s)(path);
    return !!p && p.context.isReady && !!p.sessionContext.session && !!p.sessionContext.session.kernel
           && p.sessionContext.session.kernel.status === 'idle' && p.content.widgets.length > 0; }""" % _PANEL

# Run All is over when the kernel is idle, no cell waits ([*]) and each code cell ran, or one failed (Run All stops there).
_RUN_STATE = """(path) => { const p = (%s)(path); if (!p) return null;
    const cells = p.content.widgets.filter(w => w.model.type === 'code');
    const errors = [], unrun = [];
    cells.forEach((w, i) => {
        const outs = w.model.outputs.toJSON();
        outs.filter(o => o.output_type === 'error').forEach(o => errors.push(`cell ${i}: ${o.ename}: ${o.evalue}`));
        if (w.model.executionCount === null) unrun.push(i); });
    const busy = cells.some(w => w.model.executionState === 'running' || (w.promptNode && /\\*/.test(w.promptNode.textContent || '')));
    const k = p.sessionContext.session && p.sessionContext.session.kernel;
    return {status: k ? k.status : 'none', busy, errors, unrun, cells: cells.length}; }""" % _PANEL

_MARK = """([path, snippet]) => { const p = (%s)(path);
    const i = p.content.widgets.findIndex(w => w.model.type === 'code' && w.model.sharedModel.getSource().includes(snippet));
    if (i < 0) return -1;
    p.content.widgets[i].node.setAttribute('data-pagednb-cell', String(i)); return i; }""" % _PANEL

class Lab:
    "Headless chromium on one `JupyterLab` server; `open(name)` a notebook, `run_all(page, name)`, `cell(page, name, snippet)`."
    def __init__(self, server: JupyterLab):
        self.server = server

    def __enter__(self):
        from playwright.sync_api import sync_playwright
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        self.ctx = self.browser.new_context(viewport={"width": 1500, "height": 1100}, service_workers="block")
        self.blocked, self.errors = [], []
        base = self.server.base
        def route(r):
            u = r.request.url
            if u.startswith((base, base.replace("127.0.0.1", "localhost"), "data:", "blob:", "ws:")): r.continue_()
            else:                                      # a notebook's own images (the Colab badge) are its content, not the app's
                if r.request.resource_type != "image": self.blocked.append(u)
                r.abort()
        self.ctx.route("**/*", route)
        return self

    def __exit__(self, *a):
        self.ctx.close(); self.browser.close(); self._pw.stop()

    def open(self, name, timeout=120_000):
        "A new tab with notebook `name` open and its kernel started and idle."
        page = self.ctx.new_page()
        page.on("pageerror", lambda e: self.errors.append(f"{name}: uncaught: {e}"))
        page.goto(self.server.url(f"lab/tree/{name}"), wait_until="domcontentloaded", timeout=timeout)
        page.wait_for_function(_READY, arg=name, timeout=timeout, polling=250)
        return page

    def run_all(self, page, name, timeout=240_000):
        "Run > Run All Cells (the menu command), then wait until it is over; returns the run's state (errors, unrun cells)."
        t0, deadline = time.time(), time.time() + timeout/1000
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")     # not awaited: polled
        state = None
        while time.time() < deadline:
            state = page.evaluate(_RUN_STATE, name)
            started = time.time() - t0 > 2
            if started and state["status"] == "idle" and not state["busy"] and (not state["unrun"] or state["errors"]): break
            page.wait_for_timeout(500)
        else:
            raise TimeoutError(f"{name}: Run All did not finish in {timeout/1000:.0f} s: {state}\n{self.server.log_tail()}")
        state["seconds"] = time.time() - t0
        return state

    def cell(self, page, name, snippet):
        "The locator of the (first) code cell of `name` whose source holds `snippet`."
        i = page.evaluate(_MARK, [name, snippet])
        if i < 0: raise LookupError(f"{name}: no code cell holds {snippet!r}")
        return page.locator(f'[data-pagednb-cell="{i}"]')

    def shutdown(self, page, name):
        "Shut the notebook's kernel down (memory for the next one) and close its tab."
        page.evaluate(f"async (path) => {{ const p = ({_PANEL})(path); if (p) await p.sessionContext.shutdown(); }}", name)
        page.close()
