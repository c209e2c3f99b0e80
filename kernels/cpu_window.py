#!/usr/bin/env python
"""Decode time of one long sequence against its length, with and without a sliding window, on this CPU.

    python kernels/cpu_window.py [--lengths 512,1024,2048,4096,8192] [--window 1024] [--threads 1] [--reps 20]
                                 [--out kernels/results/cpu-window.md]

One decode (one query token) of one sequence, SmolLM2-135M's head shapes by default (9 query heads, 3 KV heads,
head_dim 64, pages of 16, float32), through the C++ kernel (`paged_attention_cpu`, checked=True as the runner
calls it) and the torch backend (`paged_attention_torch` with a `TorchAttentionPlan` built for the window, as the
runner builds one per KV-cache group). With no window the time grows with the length; with a window it should
stop growing once the sequence is longer than the window. Pages wholly before the window are the null block
(NaN): a kernel that read one would return NaN, which the script checks against the spec.
"""
import argparse, os, platform, sys, time

import torch

from pagednb.attention import (TorchAttentionPlan, contiguous_attention, make_paged_problem,
                               paged_attention_torch)
from pagednb.cpu_attention import paged_attention_cpu

HERE = os.path.dirname(os.path.abspath(__file__))


def best_ms(f, *args, reps=20, **kw):
    "Best wall time of `f(*args, **kw)` over `reps` calls (after one warm-up), in milliseconds."
    f(*args, **kw)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(*args, **kw)
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def measure(L, window, a):
    "(C++ kernel ms, torch backend ms) for one decode of an `L`-token sequence with `window` (None: all)."
    p = make_paged_problem([L], num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                           block_size=a.block_size, sliding_window=window).fill()
    want = contiguous_attention(p)
    plan = TorchAttentionPlan(p.block_tables, p.seq_lens, p.query_start_loc, p.k_cache.shape[0], a.block_size,
                              sliding_window=window)
    for out in (paged_attention_cpu(*p.args, **p.kw), paged_attention_torch(*p.args, plan=plan, **p.kw)):
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    cpu = best_ms(paged_attention_cpu, *p.args, checked=True, reps=a.reps, **p.kw)
    tor = best_ms(paged_attention_torch, *p.args, plan=plan, reps=a.reps, **p.kw)
    return cpu, tor


def machine():
    "The CPU's model name, its logical cores, and the versions that matter."
    model = platform.processor() or platform.machine()
    if os.path.exists('/proc/cpuinfo'):
        names = [l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')]
        model = names[0] if names else model
    load = ", load average {:.1f}".format(os.getloadavg()[0]) if hasattr(os, 'getloadavg') else ""
    return (f"{model}, {os.cpu_count()} logical cores{load}; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def markdown(rows, a, command):
    "The results file: the command, the machine, the table."
    w = a.window
    lines = [f"# Decode time against length, with and without a sliding window (CPU)", "",
             f"Command: `{command}`", "", f"Machine: {machine()}; {a.threads} thread(s).", "",
             f"One decode of one sequence: {a.heads} query heads, {a.kv_heads} KV heads, head_dim {a.head_dim}, "
             f"pages of {a.block_size}, float32; best of {a.reps} calls, milliseconds. Pages wholly before the "
             f"window are the null block (never read); outputs checked against the dense masked softmax.", "",
             f"| tokens | C++ kernel, no window | C++ kernel, W={w} | torch backend, no window "
             f"| torch backend, W={w} |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {L} | {c0:.3f} | {c1:.3f} | {t0:.3f} | {t1:.3f} |" for L, c0, c1, t0, t1 in rows]
    base = next((r for r in rows if r[0] >= w), rows[0])                  # the first length that fills the window
    grow = [rows[-1][i] / base[i] for i in range(1, 5)]
    lines += ["", f"From {base[0]} to {rows[-1][0]} tokens the time grew {grow[0]:.1f}x with no window and "
              f"{grow[1]:.1f}x with W={w} (C++ kernel); {grow[2]:.1f}x and {grow[3]:.1f}x (torch backend)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--lengths', default='512,1024,2048,4096,8192', help='sequence lengths, comma-separated')
    ap.add_argument('--window', type=int, default=1024, help='the sliding window, tokens')
    ap.add_argument('--threads', type=int, default=1, help='torch and kernel threads')
    ap.add_argument('--reps', type=int, default=20, help='timed calls per cell (the best is kept)')
    ap.add_argument('--heads', type=int, default=9)
    ap.add_argument('--kv-heads', type=int, default=3)
    ap.add_argument('--head-dim', type=int, default=64)
    ap.add_argument('--block-size', type=int, default=16)
    ap.add_argument('--out', default=os.path.join(HERE, 'results', 'cpu-window.md'), help="'' to print only")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for L in (int(x) for x in a.lengths.split(',')):
        (c0, t0), (c1, t1) = measure(L, None, a), measure(L, a.window, a)
        rows.append((L, c0, c1, t0, t1))
        print(f"{L:>6} tokens: C++ {c0:.3f} ms, W={a.window} {c1:.3f} ms; torch {t0:.3f} ms, W={a.window} "
              f"{t1:.3f} ms", flush=True)
    md = markdown(rows, a, 'python kernels/cpu_window.py ' + ' '.join(sys.argv[1:] if argv is None else argv))
    if a.out:
        with open(a.out, 'w') as f: f.write(md)
        print(f"wrote {a.out}")
    return 0


if __name__ == '__main__': sys.exit(main())
