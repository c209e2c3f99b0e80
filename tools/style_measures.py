"""Style measures of a Python code base, to set pagednb beside nano-vllm or fastcore.

    python tools/style_measures.py                  # pagednb: pagednb/*.py (not _modidx.py) and nbs/*.ipynb
    python tools/style_measures.py PATH [PATH ...]  # each PATH's .py files (no notebooks), a column each

Functions are every `def` and `async def` that `ast` finds, nested ones and methods included. A code line
is a line that is neither blank nor only a comment; a chained line holds a `;` between statements."""
import ast, io, json, statistics, sys, tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONG, BIG = 120, 40                       # characters of a long line; lines of a long function

def code_lines(src):
    "The lines of `src` that are neither blank nor only a comment."
    return [l for l in src.splitlines() if l.strip() and not l.strip().startswith("#")]

def chained_lines(src):
    "How many lines of `src` hold a `;` that separates two statements."
    toks = tokenize.generate_tokens(io.StringIO(src).readline)
    return len({t.start[0] for t in toks if t.type == tokenize.OP and t.string == ";"})

def functions(src):
    "(non-space characters, lines) of every function in `src`."
    lines = src.splitlines()
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = "\n".join(lines[node.lineno - 1:node.end_lineno])
            out.append((sum(not c.isspace() for c in body), node.end_lineno - node.lineno + 1))
    return out

def _readable(f):
    "The text of `f` if Python can parse it (a Python 2 file or a template cannot be measured), else None."
    try:
        src = f.read_text(encoding="utf-8")
        ast.parse(src)
        return src
    except (SyntaxError, UnicodeDecodeError, ValueError): return None

def measure_py(files):
    "The code measures of some .py files (generated `_modidx.py` files left out)."
    texts = [_readable(f) for f in files if f.name != "_modidx.py"]
    srcs = [s for s in texts if s is not None]
    fns = [f for s in srcs for f in functions(s)]
    code = [l for s in srcs for l in code_lines(s)]
    n = max(1, len(code))
    return {"files": len(srcs), "files that do not parse (left out)": len(texts) - len(srcs),
            "functions": len(fns),
            "median function length (non-space chars)": statistics.median(c for c, _ in fns) if fns else 0,
            f"% code lines over {LONG} chars": 100*sum(len(l) > LONG for l in code)/n,
            "% code lines chaining statements with ;": 100*sum(chained_lines(s) for s in srcs)/n,
            f"functions over {BIG} lines": sum(k > BIG for _, k in fns)}

def _source(cell): return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]

def _exported(src): return any(l.replace(" ", "").startswith("#|export") for l in src.splitlines())

def measure_notebooks(paths):
    "Exported cells' median non-blank lines (directives left out), and how many have a test or example below."
    sizes, followed = [], 0
    for p in paths:
        cells = json.loads(p.read_text(encoding="utf-8"))["cells"]
        code = [_source(c) for c in cells if c["cell_type"] == "code"]
        for i, src in enumerate(code):
            if not _exported(src): continue
            sizes.append(sum(1 for l in src.splitlines() if l.strip() and not l.startswith("#|")))
            followed += i + 1 < len(code) and not _exported(code[i + 1])
    return {"notebooks": len(paths), "exported cells": len(sizes),
            "exported cells' median non-blank lines": statistics.median(sizes) if sizes else 0,
            "% exported cells followed by a test or example": 100*followed/max(1, len(sizes))}

def measures(path=None):
    "The measures of pagednb (`path` None) or of every .py file under `path`."
    if path is None:
        py = sorted((ROOT / "pagednb").glob("*.py"))
        return {**measure_py(py), **measure_notebooks(sorted((ROOT / "nbs").glob("*.ipynb")))}
    return measure_py(sorted(Path(path).rglob("*.py")))

def table(columns):
    "A plain-text table: one row per measure, one column per code base."
    rows = list(dict.fromkeys(k for m in columns.values() for k in m))
    fmt = lambda v: "" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
    cells = [["measure", *columns]] + [[r, *(fmt(m.get(r)) for m in columns.values())] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    line = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join(line(row) for row in cells)

if __name__ == "__main__":
    paths = sys.argv[1:]
    print(table({p: measures(p) for p in paths} if paths else {"pagednb": measures()}))
