#!/usr/bin/env python
"""Compile every paged-attention kernel ahead of time for real GPU targets, without a GPU.

Triton's wheel ships `ptxas`, so a kernel can be lowered all the way to a cubin for sm_75 (T4), sm_80 (A100),
sm_89 (L4) and sm_90 (H100/H200) on a machine with no GPU at all. This catches what the interpreter cannot:
`tl.dot` shape rules, types the GPU backend rejects, and register spills (from `ptxas -v`).

    python kernels/compile_check.py [--quick] [--json PATH]

It must run with TRITON_INTERPRET unset (the interpreter makes different kernel objects); `kernels/lab.py`
starts it in a subprocess.
"""
import argparse, json, os, re, subprocess, sys, tempfile, time

if os.environ.get('TRITON_INTERPRET', '0') not in ('', '0'):
    sys.exit('compile_check.py needs TRITON_INTERPRET unset: it compiles GPU kernels')

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import pagednb.attention as A

from triton.backends.nvidia.compiler import get_ptxas
P2 = A._next_pow2


def ptxas_stats(ptx, arch):
    "Registers and spill bytes per thread from `ptxas -v` on the kernel's PTX."
    with tempfile.NamedTemporaryFile('w', suffix='.ptx', delete=False) as f: f.write(ptx)
    try:
        r = subprocess.run([get_ptxas(arch).path, f'-arch=sm_{arch}' + ('a' if arch >= 90 else ''), '-v', f.name,
                            '-o', os.devnull], capture_output=True, text=True)
    finally: os.unlink(f.name)
    txt = r.stderr + r.stdout
    regs = re.search(r'Used (\d+) registers', txt)
    spill = re.search(r'(\d+) bytes spill stores', txt)
    return dict(registers=int(regs.group(1)) if regs else None, spill_store_bytes=int(spill.group(1)) if spill else None)


def compile_one(kernel, sig, const, arch, num_warps=4, num_stages=2):
    # pointers 16-byte aligned, as torch allocates them and as Triton's launcher specialises them at run time
    attrs = {(kernel.arg_names.index(k),): [['tt.divisibility', 16]] for k, v in sig.items() if v.startswith('*')}
    sig = dict(sig, **{k: 'constexpr' for k in const})
    t = time.time()
    ck = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget('cuda', arch, 32),
                        options=dict(num_warps=num_warps, num_stages=num_stages))
    return dict(seconds=round(time.time() - t, 2), shared_bytes=ck.metadata.shared, **ptxas_stats(ck.asm['ptx'], arch))


def attn_sig(dt):
    return dict(Q=f'*{dt}', K=f'*{dt}', V=f'*{dt}', O=f'*{dt}', BLOCK_TABLES='*i32', SEQ_LENS='*i32', QSL='*i32',
                TRACE='*i32', qk_scale='fp32', bt_stride='i32', window='i32', softcap='fp32')


def cases(quick):
    "(name, kernel, signature, constexprs, arch, num_warps, num_stages): what `plan_attention` would launch on each target."
    out = []
    dtypes = [('fp16', 75), ('bf16', 80), ('bf16', 90), ('fp16', 90), ('fp32', 90)]
    shapes = [(32, 8, 128, 16), (9, 3, 64, 16), (8, 8, 80, 8), (24, 2, 96, 128)]   # H, KVH, D, block size
    if quick: dtypes, shapes = [('fp16', 75), ('bf16', 90)], shapes[:2]
    for dt, arch in dtypes:
        prec, elem = ('ieee', 4) if dt == 'fp32' else ('tf32', 2)
        for H, KVH, D, BS in shapes:
            G = H // KVH
            # the soft cap (Gemma 2) compiled for one shape per target; the window is a plain argument of every kernel
            cap = (H, KVH, D, BS) == shapes[1]
            c = dict(H=H, KVH=KVH, G=G, D=D, D_PAD=P2(max(D, 16)), BS=BS, F32_DOT=False, PREC=prec, TRACE_ON=False,
                     SOFTCAP=cap)
            tag = f'{dt} sm_{arch} H={H} KVH={KVH} D={D} B={BS}' + (' softcap' if cap else '')
            dp = A.plan_attention(64, H, KVH, D, BS, 1, 2048, 132, arch, elem)
            out.append((f'decode {tag}', A._paged_decode_kernel, attn_sig(dt),
                        dict(c, ROWS=max(16, P2(G)), BLOCK_N=dp.block_n), arch, dp.num_warps, dp.num_stages))
            msig = dict(attn_sig(dt), O_PART='*fp32', LSE_PART='*fp32')
            msig = {k: msig[k] for k in ['Q', 'K', 'V', 'O', 'O_PART', 'LSE_PART', 'BLOCK_TABLES', 'SEQ_LENS', 'QSL',
                                         'TRACE', 'qk_scale', 'bt_stride', 'window', 'softcap']}
            mp = A.plan_attention(4, H, KVH, D, BS, 512, 512, 132, arch, elem)
            out.append((f'multi {tag}', A._paged_attention_kernel, msig,
                        dict(c, G_PAD=P2(G), BLOCK_M=mp.block_m, ROWS=max(16, mp.block_m * P2(G)), BLOCK_N=mp.block_n,
                             NUM_SPLITS=1), arch, mp.num_warps, mp.num_stages))
            out.append((f'decode-split {tag}', A._paged_attention_kernel, msig,
                        dict(c, G_PAD=P2(G), BLOCK_M=1, ROWS=max(16, P2(G)), BLOCK_N=dp.block_n, NUM_SPLITS=8),
                        arch, dp.num_warps, dp.num_stages))
        out.append((f'combine {dt} sm_{arch}', A._combine_splits_kernel, dict(O=f'*{dt}', O_PART='*fp32', LSE_PART='*fp32'),
                    dict(H=32, D=128, D_PAD=128, NUM_SPLITS=8, SPLITS_PAD=8), arch, 4, 1))
        out.append((f'store {dt} sm_{arch}', A._store_kv_kernel,
                    dict(key_ptr=f'*{dt}', value_ptr=f'*{dt}', k_cache_ptr=f'*{dt}', v_cache_ptr=f'*{dt}', slot_ptr='*i64'),
                    dict(ROW=1024, BLOCK=1024), arch, 4, 1))
        if arch < 90: continue                        # the naive kernel is slow to compile: once per dtype on sm_90
        out.append((f'naive {dt} sm_{arch} ctx 1024', A._decode_naive_kernel,
                    {k: v for k, v in attn_sig(dt).items() if k != 'TRACE'},
                    dict(H=32, KVH=8, G=4, D=128, D_PAD=128, BS=16, CTX_PAD=1024, SOFTCAP=True), arch, 4, 1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true', help='a few representative kernels only')
    ap.add_argument('--json', help='write the results here')
    a = ap.parse_args(argv)
    results = []
    for name, kernel, sig, const, arch, warps, stages in cases(a.quick):
        try: r = dict(name=name, ok=True, num_warps=warps, num_stages=stages, **compile_one(kernel, sig, const, arch, warps, stages))
        except Exception as e: r = dict(name=name, ok=False, error=f'{type(e).__name__}: {str(e)[:400]}')
        results.append(r)
        print(f"{'ok ' if r['ok'] else 'FAIL'} {name:55s} " +
              (f"{r['registers']} regs, {r['spill_store_bytes']} B spilled, {r['shared_bytes']} B smem, {r['seconds']} s"
               if r['ok'] else r['error']), flush=True)
    if a.json:
        with open(a.json, 'w') as f: json.dump(dict(triton=triton.__version__, results=results), f, indent=1)
    n_bad = sum(not r['ok'] for r in results)
    print(f"{len(results) - n_bad}/{len(results)} kernels compiled")
    return 1 if n_bad else 0


if __name__ == '__main__': sys.exit(main())
