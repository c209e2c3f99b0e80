"""The GPU check: everything that needs CUDA, in one command of under 8 minutes.

    python kernels/gpu_check.py [--quick] [--out kernels/results]

1. **greedy equality with Hugging Face on CUDA**, float32, for both attention backends (`torch`, `triton`): the
   embedded SmolLM2-135M-Instruct, a few prompts, every token id compared;
2. **the `#| gpu` cells**: `nbdev-test --flags gpu` over every notebook that has one;
3. **the kernel lab's bandwidth table** (`kernels/lab.py --quick`): decode GB/s against the device's peak;
4. **an engine throughput run**: the offline workload of `pagednb bench` on CUDA, per backend;
5. **decode graphs**: greedy tokens with `cudagraph_capture_sizes` against eager ones (every id compared), and the
   decode throughput of both on 64 short requests;
6. **sliding windows and soft caps**: every Triton variant (naive, decode, decode-split, multi, multi-split) and the
   torch backend against the spec in float32, float16 and bfloat16, windows below, at and above a page (pages of 16
   and 32; pages before the window are the NaN null block), soft cap on and off; and one long decode (8,192 tokens)
   timed with no window and with a window of 1,024.

Each step runs in its own subprocess with its own time limit, so that one failure or hang does not hide the others.
The figures go to `kernels/results/gpu-check-<device>.json` and `.md`, with the device name and the torch and
Triton versions. The exit status is 0 if every step passed, 1 if one failed, 2 if there is no CUDA device."""
import argparse, datetime, glob, json, os, platform, re, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "A short list of prime numbers: 2, 3, 5,",
           "Once upon a time, in a small village by the sea,"]
BACKENDS = ("torch", "triton")
STEP_LIMITS = dict(equality=100, notebooks=100, lab=120, throughput=70, graphs=70, window=40)   # 8.3 min at most

def _result(obj): print("GPU_CHECK_RESULT " + json.dumps(obj, default=str), flush=True)

# ---- the steps, each run as `python kernels/gpu_check.py --step NAME` --------------------------------------------

def step_equality(quick):
    "Greedy token ids of pagednb (each backend) against HF `generate`, float32 on CUDA, one prompt at a time for HF."
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from pagednb import LLM, SamplingParams
    from pagednb.model import embedded_model_path
    path, n = embedded_model_path(), 16 if quick else 48
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(path)
    ref = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([tok(p)["input_ids"]], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
            ref.append(out[0, ids.shape[1]:].tolist())
    del hf
    torch.cuda.empty_cache()
    rows = []
    for backend in BACKENDS:
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend=backend, max_model_len=512, log=False)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
        for p, r, o in zip(PROMPTS, ref, outs):
            got = list(o.outputs[0].token_ids)
            m = min(len(got), len(r))
            first = next((i for i in range(m) if got[i] != r[i]), None if len(got) == len(r) else m)
            rows.append(dict(backend=backend, prompt=p, tokens=len(got), same=got == r, first_difference=first))
        del llm
        torch.cuda.empty_cache()
    return dict(ok=all(r["same"] for r in rows), max_tokens=n, dtype="float32", rows=rows)

def gpu_notebooks():
    "The notebooks with a `#| gpu` cell."
    found = []
    for nb in sorted(glob.glob(os.path.join(ROOT, "nbs", "*.ipynb"))):
        cells = json.load(open(nb))["cells"]
        if any(c["cell_type"] == "code" and re.search(r"^#\|\s*gpu\b", "".join(c["source"]), re.M) for c in cells): found.append(nb)
    return found

def step_notebooks(quick, deadline):
    "`nbdev-test --flags gpu` on each notebook with `#| gpu` cells (all of its cells run, the gpu ones included)."
    exe = os.path.join(os.path.dirname(sys.executable), "nbdev-test")
    rows = []
    for nb in gpu_notebooks():
        left = deadline - time.time()
        if left < 10:
            rows.append(dict(notebook=os.path.basename(nb), ok=False, error="no time left"))
            continue
        t0 = time.time()
        try:
            p = subprocess.run([exe, "--flags", "gpu", nb], cwd=ROOT, capture_output=True, text=True, timeout=left,
                               env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
            rows.append(dict(notebook=os.path.basename(nb), ok=p.returncode == 0, seconds=round(time.time() - t0, 1),
                             tail=None if p.returncode == 0 else (p.stderr or p.stdout)[-1500:]))
        except subprocess.TimeoutExpired:
            rows.append(dict(notebook=os.path.basename(nb), ok=False, error=f"timed out after {left:.0f} s"))
    return dict(ok=bool(rows) and all(r["ok"] for r in rows), rows=rows)

def step_lab(quick, deadline):
    "`kernels/lab.py --quick` (validation, then decode/prefill benchmarks); the decode rows of its JSON, GB/s vs peak."
    import torch
    cmd = [sys.executable, os.path.join(HERE, "lab.py"), "--quick", "--compile-check", "none", "--cases", "40" if quick else "100"]
    t0 = time.time()
    try: p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(10, deadline - time.time()))
    except subprocess.TimeoutExpired: return dict(ok=False, error="kernels/lab.py timed out")
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    path = os.path.join(HERE, "results", slug + ".json")
    if not os.path.exists(path): return dict(ok=False, error=f"lab wrote no {path}", tail=(p.stderr or p.stdout)[-1500:])
    res = json.load(open(path))
    keep = ("model", "batch", "ctx", "dtype", "impl", "us", "gbps", "pct_peak", "error", "skipped")
    decode = [{k: r[k] for k in keep if k in r} for r in res.get("benchmarks", {}).get("decode", [])]
    prefill = res.get("benchmarks", {}).get("prefill", [])
    return dict(ok=p.returncode == 0, seconds=round(time.time() - t0, 1), peak_gbps=res["device"].get("peak_gbps"),
                validation=res["validation"]["summary"], decode=decode, prefill=prefill, lab_results=os.path.relpath(path, ROOT))

def step_throughput(quick):
    "The offline workload of `pagednb bench` on CUDA, once per attention backend, in the GPU's default dtype."
    import torch
    from pagednb.bench import make_workload, run_pagednb
    from pagednb.model import load_model
    parts = load_model(device="cuda")
    wl = make_workload(16, (32, 256), (16, 64), name="mixed-quick") if quick else make_workload(64, (32, 512), (16, 256))
    rows = []
    for backend in BACKENDS:
        r = run_pagednb(parts, wl, attention_backend=backend, kv_cache_memory_bytes=2 << 30)
        rows.append(dict(backend=backend, seconds=r["elapsed_s"], output_tok_s=r["output_tok_s"], total_tok_s=r["total_tok_s"], steps=r["steps"]))
        torch.cuda.empty_cache()
    return dict(ok=True, workload=wl.describe(), dtype=str(parts[0].lm_head.weight.dtype).replace("torch.", ""), rows=rows)

def step_graphs(quick):
    "Decode graphs on the triton backend: the same greedy tokens as eager, and decode throughput with and without."
    import torch
    from pagednb import LLM, SamplingParams
    from pagednb.model import load_model
    parts = load_model(device="cuda")
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(16 if quick else 64)]
    sp = SamplingParams(temperature=0, max_tokens=32 if quick else 128, ignore_eos=True)
    rows, tokens = [], {}
    for name, sizes in (("eager", None), ("graphs", [1, 2, 4, 8, 16, 32, 64])):
        llm = LLM(parts, attention_backend="triton", max_model_len=512, cudagraph_capture_sizes=sizes, log=False)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        captured = len(llm.engine.runner.graphs.graphs) if llm.engine.runner.graphs else 0
        rows.append(dict(mode=name, captured=captured, seconds=round(dt, 3),
                         output_tok_s=round(sum(map(len, tokens[name])) / dt, 1)))
        llm.shutdown()
    same = tokens["eager"] == tokens["graphs"]
    return dict(ok=same and rows[1]["captured"] > 0, same_tokens=same, requests=len(prompts), rows=rows)

WINDOW_TOL = dict(float32=(1e-4, 1e-4), float16=(2e-3, 2e-3), bfloat16=(1.6e-2, 1.6e-2))   # atol, rtol vs the spec

def window_cases(quick):
    "(block size, window, soft cap): windows below, at and above a page, capped and not."
    cases = [(bs, w, cap) for bs in (16, 32) for w in (5, bs, 2 * bs + 3) for cap in (None, 30.0)]
    return cases[::3] if quick else cases

def step_window(quick, device="cuda"):
    "The window and soft-cap paths of every Triton variant and the torch backend against the spec; a long decode timed."
    import torch
    from pagednb.attention import make_paged_problem, paged_attention, paged_attention_spec
    rows = []
    dtypes = ("float32", "bfloat16") if quick else ("float32", "float16", "bfloat16")
    for dt in dtypes:
        for bs, w, cap in window_cases(quick):
            atol, rtol = WINDOW_TOL[dt]
            for name, lens, qlens, runs in (
                    ("decode", [700, 33, 9, 1], None, [("naive", None), ("decode", None), ("decode", 4)]),
                    ("mixed", [700, 90, 45, 300], [1, 90, 6, 40], [(None, None), ("multi", 3)])):
                p = make_paged_problem(lens, query_lens=qlens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=bs,
                                       dtype=getattr(torch, dt), device=device, sliding_window=w, softcap=cap).fill()
                q, kc, vc, *meta = p.args
                want = paged_attention_spec(q.float(), kc.float(), vc.float(), *meta, **p.kw)
                for backend, variant, splits in [("torch", None, None)] + [("triton", v, n) for v, n in runs]:
                    kw = dict(variant=variant, num_splits=splits) if backend == "triton" else {}
                    if variant == "naive" and max(lens) > 4096: continue
                    out = paged_attention(*p.args, backend=backend, **kw, **p.kw).float()
                    err = (out - want).abs().max().item()
                    close = (out - want).abs() <= atol + rtol * want.abs()
                    ok = bool(torch.isfinite(out).all()) and bool(close.all())
                    rows.append(dict(dtype=dt, block_size=bs, window=w, softcap=cap, batch=name, backend=backend,
                                     variant=variant or "auto", splits=splits, max_err=f"{err:.1e}", ok=ok))
    timing = window_timing(device) if device == "cuda" else []
    return dict(ok=all(r["ok"] for r in rows), cases=len(rows), failed=[r for r in rows if not r["ok"]][:20],
                timing=timing)

def window_timing(device, L=8192, window=1024):
    "One decode of an L-token sequence, bf16, SmolLM2's heads: microseconds with no window and with `window`."
    import torch
    from triton.testing import do_bench
    from pagednb.attention import make_paged_problem, paged_attention
    rows = []
    for w in (None, window):
        p = make_paged_problem([L], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16,
                               device=device, sliding_window=w).fill()
        for backend in ("triton", "torch"):
            f = lambda: paged_attention(*p.args, backend=backend, max_query_len=1, max_seq_len=L, **p.kw)
            rows.append(dict(tokens=L, window=w, backend=backend, us=round(do_bench(f, warmup=5, rep=30) * 1e3, 1)))
    return rows

# ---- the driver --------------------------------------------------------------------------------------------------

def run_step(name, quick, limit):
    "Run one step in a subprocess with `limit` seconds; returns its result dict (with `seconds`), or an error."
    cmd = [sys.executable, os.path.abspath(__file__), "--step", name, "--limit", str(limit)] + (["--quick"] if quick else [])
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try: p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit + 5, env=env)
    except subprocess.TimeoutExpired: return dict(ok=False, error=f"timed out after {limit} s", seconds=round(time.time() - t0, 1))
    lines = [l for l in p.stdout.splitlines() if l.startswith("GPU_CHECK_RESULT ")]
    if not lines: return dict(ok=False, error=f"exit {p.returncode}", tail=(p.stderr or p.stdout)[-2000:], seconds=round(time.time() - t0, 1))
    return json.loads(lines[-1][len("GPU_CHECK_RESULT "):]) | dict(seconds=round(time.time() - t0, 1))

def environment():
    "The device and the versions a reader needs to compare runs."
    import torch
    import importlib.metadata as md
    def v(name):
        try: return md.version(name)
        except md.PackageNotFoundError: return None
    p = torch.cuda.get_device_properties(0)
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=torch.cuda.get_device_name(0),
                capability=f"{p.major}.{p.minor}", memory_gb=round(p.total_memory / 1e9, 1), torch=torch.__version__,
                cuda=torch.version.cuda, triton=v("triton"), transformers=v("transformers"), pagednb=v("pagednb"),
                python=platform.python_version())

def _md_table(rows, cols):
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return out + ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in rows]

def markdown(res):
    "The results as markdown tables."
    e, s = res["environment"], res["steps"]
    L = [f"# GPU check: {e['device']}", "", f"{e['date']} · capability {e['capability']}, {e['memory_gb']} GB · torch {e['torch']} "
         f"(CUDA {e['cuda']}) · Triton {e['triton']} · transformers {e['transformers']} · `python kernels/gpu_check.py"
         f"{' --quick' if res['quick'] else ''}`", ""]
    L += ["| step | ok | seconds |", "|---|---|---|"] + [f"| {k} | {v.get('ok')} | {v.get('seconds')} |" for k, v in s.items()]
    if s.get("equality", {}).get("rows"):
        L += ["", f"## Greedy equality with Hugging Face (float32, {s['equality']['max_tokens']} tokens)", ""]
        L += _md_table(s["equality"]["rows"], ["backend", "prompt", "tokens", "same", "first_difference"])
    if s.get("notebooks", {}).get("rows"):
        L += ["", "## `nbdev-test --flags gpu`", ""] + _md_table(s["notebooks"]["rows"], ["notebook", "ok", "seconds"])
    if s.get("lab", {}).get("decode"):
        L += ["", f"## Decode bandwidth (kernel lab, peak {s['lab'].get('peak_gbps')} GB/s)", ""]
        L += _md_table(s["lab"]["decode"], ["model", "batch", "ctx", "dtype", "impl", "us", "gbps", "pct_peak"])
    if s.get("throughput", {}).get("rows"):
        L += ["", f"## Engine throughput ({s['throughput']['dtype']}): {s['throughput']['workload']}", ""]
        L += _md_table(s["throughput"]["rows"], ["backend", "seconds", "output_tok_s", "total_tok_s", "steps"])
    if s.get("graphs", {}).get("rows"):
        g = s["graphs"]
        L += ["", f"## Decode graphs ({g['requests']} requests; same tokens as eager: {g['same_tokens']})", ""]
        L += _md_table(g["rows"], ["mode", "captured", "seconds", "output_tok_s"])
    if s.get("window", {}).get("cases"):
        w = s["window"]
        L += ["", f"## Sliding windows and soft caps ({w['cases']} cases against the spec; all ok: {w['ok']})", ""]
        if w.get("failed"): L += _md_table(w["failed"], ["dtype", "block_size", "window", "softcap", "batch", "backend",
                                                          "variant", "splits", "max_err"])
        if w.get("timing"): L += [""] + _md_table(w["timing"], ["tokens", "window", "backend", "us"])
    errors = [f"- {k}: {v.get('error')}\n\n```\n{v.get('tail') or ''}\n```" for k, v in s.items() if v.get("error")]
    return "\n".join(L + ([""] + errors if errors else [])) + "\n"

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter outputs, a smaller workload, fewer lab cases")
    ap.add_argument("--only", default=",".join(STEP_LIMITS), help=f"comma-separated steps, from {','.join(STEP_LIMITS)}")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder of the results (default kernels/results)")
    ap.add_argument("--step", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): this check needs an NVIDIA GPU. "
              "On a CPU, run `python kernels/lab.py` (validation through the Triton interpreter) and the tests instead.",
              file=sys.stderr)
        return 2
    if a.step:
        deadline = time.time() + (a.limit or 300)
        fn = dict(equality=lambda: step_equality(a.quick), notebooks=lambda: step_notebooks(a.quick, deadline),
                  lab=lambda: step_lab(a.quick, deadline), throughput=lambda: step_throughput(a.quick),
                  graphs=lambda: step_graphs(a.quick), window=lambda: step_window(a.quick))[a.step]
        _result(fn())
        return 0
    steps = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEP_LIMITS]
    if bad: ap.error(f"--only: unknown step(s) {bad}; choose from {', '.join(STEP_LIMITS)}")
    res = dict(environment=environment(), quick=a.quick, steps={})
    print(f"gpu_check on {res['environment']['device']} (torch {res['environment']['torch']}, Triton {res['environment']['triton']})", flush=True)
    for s in steps:
        print(f"gpu_check: {s} ...", flush=True)
        res["steps"][s] = r = run_step(s, a.quick, STEP_LIMITS[s])
        print(f"gpu_check: {s}: {'ok' if r.get('ok') else 'FAILED ' + str(r.get('error', ''))} ({r.get('seconds')} s)", flush=True)
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, "gpu-check-" + re.sub(r"[^a-z0-9]+", "-", res["environment"]["device"].lower()).strip("-"))
    with open(base + ".json", "w") as f: json.dump(res, f, indent=1, default=str)
    with open(base + ".md", "w") as f: f.write(markdown(res))
    print(markdown(res))
    print(f"results in {base}.json and .md")
    return 0 if all(r.get("ok") for r in res["steps"].values()) else 1

if __name__ == "__main__": sys.exit(main())
