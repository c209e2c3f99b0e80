"""What must never import what (ARCHITECTURE.md), checked with `ast` over `pagednb/*.py`.

Every import is read, at module level and inside functions, in its relative (`from .engine import x`) and
absolute (`from pagednb.engine import x`, `import pagednb.engine as E`) forms. A failure names the file, the
line and the rule."""
import ast
from pathlib import Path
import pytest

PKG = Path(__file__).resolve().parent.parent / "pagednb"
MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "_modidx")
KERNELS = ("attention", "cpu_attention", "cpu_ops", "amx_attention")
VIEWS = ("plots", "figures", "compare_views", "attention_views", "widgets", "sim_views")     # the drawing code

def _target(node):
    "The pagednb module (`'engine'`; `'__init__'` for the package) or the top-level package an import names."
    if isinstance(node, ast.Import): return [_absolute(a.name) for a in node.names]
    if node.level:                                             # from . import x / from .x import y
        base = node.module or ""
        return [_submodule(base, a.name) for a in node.names]
    if node.module == "pagednb": return [_submodule("", a.name) for a in node.names]
    return [_absolute(node.module)]

def _absolute(name):
    parts = name.split(".")
    if parts[0] != "pagednb": return parts[0]                 # another package: its top-level name
    return "pagednb." + (parts[1] if len(parts) > 1 else "__init__")

def _submodule(base, name):
    "`from .base import name` / `from pagednb import name`: a module of the package where one has that name."
    if base: return "pagednb." + base.split(".")[0]
    return "pagednb." + (name if name in MODULES else "__init__")

class _Imports(ast.NodeVisitor):
    "Each import of a file as (line, target, source text, inside a function?)."
    def __init__(self, src): self.src, self.found, self.depth = src, [], 0
    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function
    def _import(self, node):
        text = ast.get_source_segment(self.src, node)
        for t in _target(node): self.found.append((node.lineno, t, text, self.depth > 0))
    visit_Import = visit_ImportFrom = _import

def imports(module):
    "The imports of `pagednb/<module>.py`: (line, target, text, in_function)."
    src = (PKG / f"{module}.py").read_text()
    v = _Imports(src)
    v.visit(ast.parse(src))
    return v.found

ALL = {m: imports(m) for m in MODULES}

def graph():
    "pagednb module -> the pagednb modules it imports (module level and inside functions)."
    return {m: sorted({t[len("pagednb."):] for _, t, _, _ in ALL[m] if t.startswith("pagednb.")} - {m})
            for m in MODULES}

def where(module, line, text): return f"pagednb/{module}.py:{line}: `{text}`"

def importers_of(modules, forbidden):
    "Each import, by one of `modules`, of a pagednb module in `forbidden`: (module, line, text)."
    return [(m, line, text) for m in modules if m in ALL for line, t, text, _ in ALL[m]
            if t in {f"pagednb.{f}" for f in forbidden}]

def check(violations, rule):
    assert not violations, f"{rule}:\n" + "\n".join(where(*v) for v in violations)

def torch_importers(module, seen=None):
    "Imports of torch by `module` or by any pagednb module it imports, directly or not: (module, line, text)."
    seen = set() if seen is None else seen
    if module in seen or module not in ALL: return []
    seen.add(module)
    found = [(module, line, text) for line, t, text, _ in ALL[module] if t == "torch"]
    for dep in graph()[module]: found += torch_importers(dep, seen)
    return found

@pytest.mark.parametrize("module", ["block_manager", "prefix_cache", "kv_offload"])
def test_memory_bookkeeping_imports_no_torch(module):
    check(torch_importers(module), f"{module} imports no torch (memory bookkeeping knows no tensors), "
                                   "not even through another pagednb module")

def test_scheduler_imports_no_model_runner_or_engine():
    check(importers_of(["scheduler"], ["model", "runner", "engine"]),
          "the scheduler plans and the runner runs: the scheduler imports no model, runner or engine")

def test_kernels_are_leaves():
    check(importers_of(KERNELS, ["engine", "runner", "scheduler", *VIEWS]),
          "kernels (attention, cpu_attention, cpu_ops, amx_attention) are leaves: they import no engine, runner, scheduler "
          "or view")

SERVER = ["protocol", "metrics", "core", "core_client", "serving", "serve"]     # the server's rooms, lowest first

def test_engine_imports_no_view_or_server():
    check(importers_of(["engine"], [*VIEWS, *SERVER]), "the engine imports no views and no server")

@pytest.mark.parametrize("room,above", [("protocol", ["engine", "core", "core_client", "serving", "serve"]),
                                        ("metrics", ["engine", "core", "core_client", "serving", "serve"]),
                                        ("core", ["core_client", "serving", "serve"]),
                                        ("core_client", ["serving", "serve"]), ("serving", ["serve"])])
def test_server_rooms_import_only_lower_rooms(room, above):
    check(importers_of([room], above), f"{room} imports none of the server's higher rooms ({', '.join(above)}): "
                                       "protocol and metrics < core < core_client < serving < serve")

@pytest.mark.parametrize("room", ["core", "core_client"])
def test_engine_core_knows_no_http(room):
    found = [(room, line, text) for line, t, text, _ in ALL[room] if t in ("fastapi", "starlette", "uvicorn")]
    check(found, f"{room} speaks to the engine, not to HTTP: it imports no fastapi, starlette or uvicorn")

def test_trace_is_data():
    check(importers_of(["trace"], [*VIEWS, "live_engine"]), "the trace is data, drawn by others: it imports no views")

def test_views_sit_on_top():
    below = [m for m in MODULES if m not in VIEWS]
    check(importers_of(below, VIEWS), "views (plots, figures, compare_views, attention_views, widgets, sim_views) sit "
                                      "above the engine, the trace and the simulator: nothing below imports them")

def test_views_draw_and_run_nothing():
    drawing = ["plots", "figures", "compare_views", "attention_views", "widgets"]
    check(importers_of(drawing, ["engine", "runner", "model", "scheduler", "sim"]),
          "the views draw traces and snapshots: they import no engine, runner, model, scheduler or simulator "
          "(live_engine runs the engine for the stepper)")

def test_block_manager_keeps_books_only():
    found = [(m, line, text) for m in ("block_manager", "prefix_cache") for line, t, text, _ in ALL[m]
             if t in ("plotly", "pagednb.plots", "ipywidgets")]
    check(found, "block_manager and prefix_cache keep the books: their colours and drawing are in plots")

def test_simulator_imports_no_widgets():
    check([("sim", line, text) for line, t, text, _ in ALL["sim"] if t == "ipywidgets"],
          "the simulator is plain Python: its widget is in sim_views")

def test_vllm_readers_are_data_code():
    readers = [m for m in ("vllm_read", "vllm_events") if m in ALL]
    check(importers_of(readers, [m for m in MODULES if m not in readers]),
          "the vLLM readers (vllm_read, vllm_events) are data code on the lowest floor: they import no engine, "
          "runner, model, simulator, widgets or server")
    check([v for m in readers for v in torch_importers(m)], "the vLLM readers import no torch")


def test_offline_benchmarks_know_no_server():
    check(importers_of(["bench"], [*SERVER, "bench_serving", "bench_cli"]),
          "bench (the offline benchmarks) runs the engine in-process: it imports no server room, bench_serving "
          "or bench_cli")

def test_serving_benchmarks_sit_on_the_offline_ones():
    check(importers_of(["bench_serving"], ["bench_cli", *SERVER]),
          "bench_serving starts servers as subprocesses: it imports no bench_cli and no server room (bench below it)")

def test_the_replayer_is_a_client():
    check(importers_of(["replay"], [*SERVER, "bench_cli"]),
          "replay talks to servers over HTTP (and starts them as subprocesses through bench_serving): it imports no "
          "server room and no bench_cli")

def test_only_the_cli_imports_the_bench_command_line():
    check(importers_of([m for m in MODULES if m != "cli"], ["bench_cli"]),
          "bench_cli (the command line over bench and bench_serving) is imported by cli alone")

def test_no_pagednb_import_inside_a_function():
    found = [(m, line, text) for m in MODULES for line, t, text, inside in ALL[m]
             if inside and t.startswith("pagednb.")]
    check(found, "no import of a pagednb module inside a function (import it at the top; if that makes a "
                 "circle, the code is in the wrong module)")

def find_cycle(g):
    "One import circle of graph `g` as a list of modules (first == last), or None."
    state, path = {}, []
    def visit(m):
        state[m] = "open"
        path.append(m)
        for d in g.get(m, []):
            if state.get(d) == "open": return path[path.index(d):] + [d]
            if d not in state and (c := visit(d)): return c
        state[m] = "done"
        path.pop()
        return None
    for m in g:
        if m not in state and (c := visit(m)): return c
    return None

def test_no_import_cycle():
    cycle = find_cycle(graph())
    if cycle is None: return
    sites = [where(a, line, text) for a, b in zip(cycle, cycle[1:]) for line, t, text, _ in ALL[a]
             if t == f"pagednb.{b}"]
    pytest.fail("import circle: " + " -> ".join(cycle) + "\n" + "\n".join(sites))

def test_the_checks_see_every_form():
    "The reader itself: relative, absolute, package-level and in-function imports all resolve to the module."
    src = ("from .engine import LLM\nimport pagednb.runner as R\nfrom pagednb import scheduler, __version__\n"
           "def f():\n    from pagednb.trace import Trace\n    import torch.nn\n")
    v = _Imports(src)
    v.visit(ast.parse(src))
    got = [(t, inside) for _, t, _, inside in v.found]
    assert got == [("pagednb.engine", False), ("pagednb.runner", False), ("pagednb.scheduler", False),
                   ("pagednb.__init__", False), ("pagednb.trace", True), ("torch", True)], got
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": []}) is None


# --- the floor plan of ARCHITECTURE.md, as allow-lists: a module may import only modules on lower floors ---

FLOORS = {   # floor -> the modules on it, as ARCHITECTURE.md draws them
    1: ["__init__", "kv_cache", "block_manager", "hybrid_kv", "attention", "sampling", "trace", "protocol",
        "metrics", "vllm_read", "vllm_events"],
    2: ["model", "scheduler", "prefix_cache", "plots"],
    3: ["cpu_attention", "engine_args", "figures", "kv_offload"],
    4: ["cpu_ops", "amx_attention", "compare_views", "attention_views"],
    5: ["runner"], 6: ["spec_decode"], 7: ["engine"],
    8: ["core", "live_engine", "bench", "sim", "puzzles"],
    9: ["core_client", "widgets", "sim_views", "bench_serving"], 10: ["serving", "replay"],
    11: ["serve", "bench_cli"], 12: ["cli"],
}
FLOOR = {m: f for f, ms in FLOORS.items() for m in ms}

def allowed(module):
    "The allow-list of `module`: every module on a lower floor."
    return {m for m, f in FLOOR.items() if f < FLOOR[module]}

def test_every_module_has_a_floor():
    missing = sorted(set(MODULES) - set(FLOOR))
    assert not missing, f"modules {missing} are on no floor of ARCHITECTURE.md's plan: place them in FLOORS and there"

@pytest.mark.parametrize("module", MODULES)
def test_imports_only_lower_floors(module):
    bad = [(module, line, text) for line, t, text, _ in ALL[module]
           if t.startswith("pagednb.") and t[len("pagednb."):] not in allowed(module) | {module, "__init__"}]
    check(bad, f"{module} (floor {FLOOR[module]}) may import only modules on lower floors")

def test_floor_plan_matches_architecture_md():
    text = (PKG.parent / "ARCHITECTURE.md").read_text()
    for f, ms in FLOORS.items():
        for m in ms:
            if m != "__init__": assert m in text, f"ARCHITECTURE.md's floor plan lacks {m}"
