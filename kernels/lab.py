#!/usr/bin/env python
"""The kernel lab for pagednb's paged attention: validate every kernel version against the spec, then measure.

    python kernels/lab.py            # everything this machine can do
    python kernels/lab.py --help     # options (case count, seed, tuning sweep, output folder)

1. Validation. Every version (the KV store, v1 naive decode, v2 online-softmax decode, v3 multi-token, v3 split-K,
   the automatic dispatch and the torch backend) against `paged_attention_spec` in float32, over many random
   shapes: ragged lengths, lengths that are not a multiple of the block size, length 1, permuted and shared
   blocks, GQA ratios 1-8, head dims 64/80/96/128, block sizes 8-128, decode, prefill and mixed batches.
2. Compile check (no GPU needed): `kernels/compile_check.py` lowers every kernel to a cubin for sm_75/80/90 with
   Triton's bundled ptxas and reports registers and spills.
3. Benchmarks (GPU only): achieved bandwidth of each version for decode against the device's peak (table below)
   beside torch SDPA on the same K/V gathered contiguous, and FlashAttention / FlashInfer when installed;
   prefill time against torch SDPA (causal, contiguous).

On a CPU it validates through Triton's interpreter (TRITON_INTERPRET=1) on fewer, smaller shapes, runs the
compile check, and says that the benchmarks need a GPU. Results go to kernels/results/<device>.json and .md.
"""
import argparse, datetime, importlib.metadata as md, json, math, os, platform, random, re, subprocess, sys, time, traceback

import torch

GPU = torch.cuda.is_available()
if not GPU: os.environ.setdefault('TRITON_INTERPRET', '1')   # before anything imports triton
import triton
import torch.nn.functional as F

import pagednb.attention as A

HERE = os.path.dirname(os.path.abspath(__file__))
DEV = 'cuda'   # where the benchmarks build their tensors

# Peak DRAM bandwidth, GB/s (1e9 bytes/s), from the vendors' data sheets. First substring match of
# torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_GBPS = [
    ('GH200', 4000), ('H200', 4800), ('H100 NVL', 3900), ('H100 PCIe', 2000), ('H100', 3350), ('H800', 3350),
    ('B200', 8000), ('A100-SXM4-80GB', 2039), ('A100 80GB PCIe', 1935), ('A100-SXM4-40GB', 1555),
    ('A100-PCIE-40GB', 1555), ('A100', 1555), ('A10G', 600), ('A10', 600), ('A40', 696), ('A6000', 768),
    ('L40S', 864), ('L40', 864), ('L4', 300), ('T4', 320), ('V100', 900), ('RTX 4090', 1008), ('RTX 3090', 936),
]

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
BYTES_FORMULA = ('bytes = sum_s L_s * n_kv_heads * head_dim * 2 (K and V) * elem  +  2 * T * n_heads * head_dim * elem '
                 '(query in, output out)  +  sum_s ceil(L_s / block_size) * 4 (block table)')


def peak_gbps(name):
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def versions():
    def v(name):
        try: return md.version(name)
        except md.PackageNotFoundError: return None
    return dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                pagednb=v('pagednb'), flash_attn=v('flash-attn') or v('flash_attn'), flashinfer=v('flashinfer-python') or v('flashinfer'),
                cuda=torch.version.cuda)


def device_info():
    if not GPU:
        return dict(name=f'CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)', kind='cpu',
                    interpreted=A.INTERPRETED, peak_gbps=None)
    p = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    return dict(name=name, kind='cuda', capability=f'{p.major}.{p.minor}', sms=p.multi_processor_count,
                memory_gb=round(p.total_memory / 1e9, 1), peak_gbps=peak_gbps(name), interpreted=A.INTERPRETED)


# --- validation ---------------------------------------------------------------------------------------------------

def random_case(rng):
    "A random batch description: ragged, length 1, non-multiples of the block, shared prefixes, mixed queries."
    kind = rng.choice(['decode', 'decode', 'mixed', 'prefill'])
    bs = rng.choice([8, 16, 32, 64, 128])
    kvh = rng.choice([1, 2, 4] if GPU else [1, 2])
    group = rng.choice([1, 2, 3, 4, 8])
    D = rng.choice([64, 80, 96, 128])
    S = rng.randint(1, 8 if GPU else 3)
    maxlen = rng.choice([1, 9, 40, 200, 700, 2000] if GPU else [1, 9, 17, 30, 45])
    lens = [rng.randint(1, maxlen) for _ in range(S)]
    if rng.random() < 0.3: lens[rng.randrange(S)] = 1
    if kind == 'decode': qlens = [1] * S
    elif kind == 'prefill': qlens = list(lens)
    else: qlens = [rng.choice([1, L, rng.randint(1, L)]) for L in lens]
    shared = 0
    if rng.random() < 0.35:
        room = min(L - n for L, n in zip(lens, qlens))
        shared = rng.randint(0, room) if room > 0 else 0
    dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if not GPU or torch.cuda.is_bf16_supported() else [])
    dtype = rng.choice(dtypes) if GPU else rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    # a layer's sliding window (below, at or above a page; pages before it become the NaN null block) and soft cap
    window = rng.choice([1, 5, bs, 2 * bs + 3, rng.randint(1, max(lens))]) if rng.random() < 0.4 else None
    softcap = rng.choice([5.0, 30.0]) if rng.random() < 0.3 else None
    return dict(kind=kind, seq_lens=lens, query_lens=qlens, num_heads=kvh * group, num_kv_heads=kvh, head_dim=D,
                block_size=bs, dtype=dtype, shared_prefix=shared, seed=rng.randrange(2**31), sliding_window=window,
                softcap=softcap)


def make(case, device):
    c = {k: v for k, v in case.items() if k != 'kind'}
    return A.make_paged_problem(c.pop('seq_lens'), device=device, **c)


def spec32(p):
    q, kc, vc, bt, sl, qsl, sc = p.args
    return A.paged_attention_spec(q.float(), kc.float(), vc.float(), bt, sl, qsl, sc, **p.kw)


def attention_versions(case, rng):
    "(name, fn(p) -> out) for every version that applies to this case."
    mq, ml = max(case['query_lens']), max(case['seq_lens'])
    decode = mq == 1
    splits = rng.randint(2, 6)
    out = []
    if decode and ml <= 4096: out.append(('v1-naive', lambda p: A.paged_decode_naive(*p.args, max_seq_len=ml, **p.kw)))
    if decode: out.append(('v2-decode', lambda p: A.paged_decode(*p.args, **p.kw)))
    out.append(('v3-multi', lambda p: A.paged_attention_multi(*p.args, max_query_len=mq, **p.kw)))
    out.append((f'v3-split', lambda p: A.paged_attention_multi(*p.args, max_query_len=mq, num_splits=splits,
                                                                 block_m=1 if decode else None, **p.kw)))
    out.append(('auto-triton', lambda p: A.paged_attention(*p.args, backend='triton', debug=True, **p.kw)))
    out.append(('torch-backend', lambda p: A.paged_attention(*p.args, backend='torch', **p.kw)))
    return out


def validate(n_cases, seed, device):
    rng = random.Random(seed)
    rows = []
    for i in range(n_cases):
        case = random_case(rng)
        desc = {k: (str(v).replace('torch.', '') if k == 'dtype' else v) for k, v in case.items()}
        # the KV store: write this step's tokens into a NaN cache, compare with plain indexing, bit for bit
        p, ref = make(case, device), make(case, device).fill()
        t = time.time()
        A.store_kv(p.key, p.value, p.k_cache, p.v_cache, p.slot_mapping, backend='triton', debug=True)
        ok = torch.equal(p.k_cache.nan_to_num(), ref.k_cache.nan_to_num()) and torch.equal(p.v_cache.nan_to_num(), ref.v_cache.nan_to_num())
        rows.append(dict(case=i, version='store', ok=ok, max_abs_err=0.0 if ok else None, seconds=round(time.time() - t, 3), **desc))
        spec = spec32(ref)
        atol, rtol = TOL[case['dtype']]
        for name, fn in attention_versions(case, rng):
            t = time.time()
            try:
                out = fn(ref)
                if device == 'cuda': torch.cuda.synchronize()
                err = (out.float() - spec).abs()
                ok = bool((err <= atol + rtol * spec.abs()).all()) and out.dtype == case['dtype']
                row = dict(max_abs_err=float(err.max()) if err.numel() else 0.0)
            except Exception as e:
                ok, row = False, dict(error=f'{type(e).__name__}: {e}'[:300])
            rows.append(dict(case=i, version=name, ok=ok, seconds=round(time.time() - t, 3), **row, **desc))
        bad = [r['version'] for r in rows if r['case'] == i and not r['ok']]
        print(f"case {i:3d} {case['kind']:7s} S={len(case['seq_lens'])} L<={max(case['seq_lens']):5d} "
              f"H={case['num_heads']:2d}/{case['num_kv_heads']} D={case['head_dim']:3d} B={case['block_size']:3d} "
              f"{str(case['dtype'])[6:]:8s} shared={case['shared_prefix']:3d} W={case['sliding_window']} "
              f"cap={case['softcap']}: {'ok' if not bad else 'FAIL ' + ', '.join(bad)}",
              flush=True)
    return rows


def validation_summary(rows):
    out = {}
    for r in rows:
        s = out.setdefault(r['version'], dict(cases=0, failed=0, max_abs_err={}))
        s['cases'] += 1; s['failed'] += not r['ok']
        if r.get('max_abs_err') is not None:
            s['max_abs_err'][r['dtype']] = max(s['max_abs_err'].get(r['dtype'], 0.0), r['max_abs_err'])
    return out


# --- compile check ------------------------------------------------------------------------------------------------

def compile_check(full):
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    env.setdefault('TRITON_DEFAULT_FP_FUSION', '1')
    path = os.path.join(HERE, 'results', '.compile_check.tmp')
    cmd = [sys.executable, os.path.join(HERE, 'compile_check.py'), '--json', path] + ([] if full else ['--quick'])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(r.stdout, end='')
    if r.returncode not in (0, 1): print(r.stderr[-2000:])
    try:
        with open(path) as f: res = json.load(f)
        os.unlink(path)
        return res
    except OSError: return dict(error=r.stderr[-2000:])


# --- benchmarks (GPU) ---------------------------------------------------------------------------------------------

def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode='median')


def gpu_problem(S, ctx, H, KVH, D, bs, dtype, q_len=1):
    "A paged batch built directly on the GPU: every sequence `ctx` tokens long, pages in a random order."
    dev = DEV
    pages = -(-ctx // bs)
    NB = S * pages + 1
    k_cache = torch.randn(NB, bs, KVH, D, dtype=dtype, device=dev)
    v_cache = torch.randn(NB, bs, KVH, D, dtype=dtype, device=dev)
    bt = torch.randperm(NB, device=dev)[:S * pages].view(S, pages).to(torch.int32).contiguous()
    seq_lens = torch.full((S,), ctx, dtype=torch.int32, device=dev)
    qsl = (torch.arange(S + 1, device=dev) * q_len).to(torch.int32)
    query = torch.randn(S * q_len, H, D, dtype=dtype, device=dev)
    return (query, k_cache, v_cache, bt, seq_lens, qsl, D ** -0.5)


def contiguous_kv(args, ctx):
    "The same K/V gathered to [S, KVH, ctx, D], as a contiguous-cache engine would hold them."
    q, kc, vc, bt, sl, qsl, sc = args
    S, (_, bs, KVH, D) = bt.shape[0], kc.shape
    k = kc[bt.long()].view(S, -1, KVH, D)[:, :ctx].transpose(1, 2).contiguous()
    v = vc[bt.long()].view(S, -1, KVH, D)[:, :ctx].transpose(1, 2).contiguous()
    return k, v


def peers_decode(args, ctx, H, KVH, D, bs):
    "(name, fn) of the comparison points that are installed."
    q, kc, vc, bt, sl, qsl, sc = args
    S = bt.shape[0]
    k, v = contiguous_kv(args, ctx)
    out = [('torch SDPA (contiguous K/V)', lambda: F.scaled_dot_product_attention(q.view(S, H, 1, D), k, v, scale=sc, enable_gqa=True))]
    try:
        from flash_attn import flash_attn_with_kvcache
        kn, vn = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()   # [S, ctx, KVH, D]
        out.append(('flash_attn_with_kvcache (contiguous)', lambda: flash_attn_with_kvcache(
            q.view(S, 1, H, D), kn, vn, cache_seqlens=sl, softmax_scale=sc, causal=True)))
    except Exception as e: out.append(('flash_attn', f'not available: {type(e).__name__}: {str(e)[:120]}'))
    try:
        import flashinfer
        pages = bt.shape[1]
        ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEV)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, 'NHD')
        indptr = (torch.arange(S + 1, device=DEV) * pages).to(torch.int32)
        last = torch.full((S,), (ctx - 1) % bs + 1, dtype=torch.int32, device=DEV)
        w.plan(indptr, bt.flatten(), last, H, KVH, D, bs, q_data_type=q.dtype, kv_data_type=q.dtype)
        out.append((f'flashinfer paged decode (page {bs})', lambda: w.run(q, (kc, vc))))
    except Exception as e: out.append(('flashinfer', f'not available: {type(e).__name__}: {str(e)[:120]}'))
    return out


DECODE_MODELS = {'llama3-8b (32/8 heads, d128)': (32, 8, 128), 'smollm2-135m (9/3 heads, d64)': (9, 3, 64)}
DECODE_BATCHES, DECODE_CTXS = [1, 8, 32, 64, 128], [1024, 4096, 16384]
PREFILL_SHAPES = [(1, 4096, 0), (4, 1024, 0), (8, 512, 0), (2, 2048, 1536)]   # batch, length, tokens already cached


def bench_decode(dtype, bs, quick):
    dev = device_info()
    peak = dev['peak_gbps']
    mem = torch.cuda.get_device_properties(0).total_memory
    rows = []
    batches = DECODE_BATCHES if not quick else DECODE_BATCHES[::2]
    ctxs = DECODE_CTXS if not quick else DECODE_CTXS[:2]
    for model, (H, KVH, D) in DECODE_MODELS.items():
        for S in batches:
            for ctx in ctxs:
                nbytes = A.decode_bytes([ctx] * S, S, H, KVH, D, bs, torch.tensor([], dtype=dtype).element_size())
                if 3 * nbytes > mem * 0.6: continue
                args = gpu_problem(S, ctx, H, KVH, D, bs, dtype)
                plan = A.plan_attention(S, H, KVH, D, bs, 1, ctx, dev['sms'])
                ref = A.paged_attention_torch(*args).float()
                cands = [('auto (' + plan.variant + (f' x{plan.num_splits}' if plan.num_splits > 1 else '') + ')',
                          lambda: A.paged_attention(*args, backend='triton', max_query_len=1, max_seq_len=ctx)),
                         ('v2-decode', lambda: A.paged_decode(*args)),
                         (f'v3-split x{max(plan.num_splits, 4)}', lambda: A.paged_attention_multi(
                             *args, max_query_len=1, num_splits=max(plan.num_splits, 4), block_m=1))]
                if ctx <= 2048: cands.append(('v1-naive', lambda: A.paged_decode_naive(*args, max_seq_len=ctx)))
                cands += peers_decode(args, ctx, H, KVH, D, bs)
                for name, fn in cands:
                    row = dict(model=model, batch=S, ctx=ctx, block_size=bs, dtype=str(dtype)[6:], impl=name, bytes=nbytes)
                    if isinstance(fn, str): row['skipped'] = fn
                    else:
                        try:
                            o = fn()
                            if name.startswith(('auto', 'v')):
                                row['max_abs_err_vs_torch'] = float((o.float() - ref).abs().max())
                            ms = bench(fn)
                            row.update(us=round(ms * 1e3, 1), gbps=round(nbytes / ms / 1e6, 1),
                                       pct_peak=round(100 * nbytes / ms / 1e6 / peak, 1) if peak else None)
                        except Exception as e: row['error'] = f'{type(e).__name__}: {str(e)[:200]}'
                    rows.append(row)
                    print(f"decode {model[:12]:12s} B={S:3d} ctx={ctx:5d} {name:40s} " +
                          (f"{row['us']:9.1f} us {row['gbps']:7.0f} GB/s" + (f" {row['pct_peak']:5.1f}% of peak" if peak else '')
                           if 'us' in row else row.get('skipped', row.get('error', ''))), flush=True)
                del args
                torch.cuda.empty_cache()
    return rows


def bench_prefill(dtype, bs, quick):
    H, KVH, D = 32, 8, 128
    rows = []
    shapes = PREFILL_SHAPES if not quick else PREFILL_SHAPES[1:2]
    for S, L, cached in shapes:
        n = L - cached
        args = gpu_problem(S, L, H, KVH, D, bs, dtype, q_len=n)
        q, kc, vc, bt, sl, qsl, sc = args
        k, v = contiguous_kv(args, L)
        qq = q.view(S, n, H, D).transpose(1, 2).contiguous()
        flops = 4 * H * D * S * (n * cached + n * (n + 1) / 2)
        ref = A.paged_attention_torch(*args).float()
        if cached == 0: sdpa = lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=sc, enable_gqa=True)
        else:
            mask = torch.arange(L, device=DEV)[None, :] <= torch.arange(cached, L, device=DEV)[:, None]
            sdpa = lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=sc, enable_gqa=True)
        cands = [('auto (multi)', lambda: A.paged_attention(*args, backend='triton', max_query_len=n, max_seq_len=L)),
                 ('torch SDPA (contiguous K/V)', sdpa)]
        try:
            from flash_attn import flash_attn_func
            qn, kn, vn = q.view(S, n, H, D), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            cands.append(('flash_attn_func (contiguous)', lambda: flash_attn_func(qn, kn, vn, softmax_scale=sc, causal=True)))
        except Exception as e: cands.append(('flash_attn', f'not available: {type(e).__name__}'))
        res = {}
        for name, fn in cands:
            row = dict(batch=S, seq_len=L, cached=cached, new_tokens=n, dtype=str(dtype)[6:], impl=name)
            if isinstance(fn, str): row['skipped'] = fn
            else:
                try:
                    o = fn()
                    if name.startswith('auto'): row['max_abs_err_vs_torch'] = float((o.float() - ref).abs().max())
                    ms = bench(fn)
                    res[name] = ms
                    row.update(us=round(ms * 1e3, 1), tflops=round(flops / ms / 1e9, 1))
                except Exception as e: row['error'] = f'{type(e).__name__}: {str(e)[:200]}'
            rows.append(row)
        base = res.get('torch SDPA (contiguous K/V)')
        for row in rows[-len(cands):]:
            if base and row['impl'] in res: row['x_sdpa'] = round(res[row['impl']] / base, 2)
            print(f"prefill S={S} L={L:5d} cached={cached:5d} {row['impl']:32s} " +
                  (f"{row['us']:9.1f} us {row['tflops']:6.1f} TFLOP/s {row.get('x_sdpa', '')}x SDPA" if 'us' in row else
                   row.get('skipped', row.get('error', ''))), flush=True)
        del args, k, v
        torch.cuda.empty_cache()
    return rows


TUNE_DECODE, TUNE_PREFILL = (32, 8, 128, 32, 4096), (4, 1024)   # (H, KVH, D, batch, ctx), (batch, length)


def tune(dtype, bs):
    "Sweep tile sizes and launch settings of the decode and multi-token kernels on one shape each."
    out = []
    H, KVH, D, S, ctx = TUNE_DECODE
    args = gpu_problem(S, ctx, H, KVH, D, bs, dtype)
    nbytes = A.decode_bytes([ctx] * S, S, H, KVH, D, bs, args[0].element_size())
    for bn in sorted({max(bs, 16), max(bs, 32), max(bs, 64), 128}):
        for w in (2, 4, 8):
            for st in (1, 2, 3, 4):
                try: ms = bench(lambda: A.paged_decode(*args, block_n=bn, num_warps=w, num_stages=st))
                except Exception as e: continue
                out.append(dict(kernel='decode', block_n=bn, num_warps=w, num_stages=st, us=round(ms * 1e3, 1),
                                gbps=round(nbytes / ms / 1e6, 1)))
    S, L = TUNE_PREFILL
    args = gpu_problem(S, L, H, KVH, D, bs, dtype, q_len=L)
    for bm in (4, 8, 16, 32):
        for bn in sorted({max(bs, 32), max(bs, 64), 128}):
            for w in (4, 8):
                for st in (1, 2, 3):
                    try: ms = bench(lambda: A.paged_attention_multi(*args, max_query_len=L, block_m=bm, block_n=bn,
                                                                   num_warps=w, num_stages=st))
                    except Exception: continue
                    out.append(dict(kernel='multi', block_m=bm, block_n=bn, num_warps=w, num_stages=st, us=round(ms * 1e3, 1)))
    for k in ('decode', 'multi'):
        best = min((r for r in out if r['kernel'] == k), key=lambda r: r['us'], default=None)
        print(f'tune {k}: best {best}')
    return out


# --- report -------------------------------------------------------------------------------------------------------

def markdown(res):
    d = res['device']
    L = [f"# Kernel lab: {d['name']}", '', f"{res['date']} · " + ' · '.join(f'{k} {v}' for k, v in res['versions'].items() if v),
         f"· Triton interpreted: {d['interpreted']}", '']
    if res.get('note'): L += [f"> {res['note']}", '']
    L += ['## Validation against the spec (float32)', '',
          f"{res['validation']['cases']} random cases, seed {res['validation']['seed']}. Tolerance |out - spec| <= atol + rtol |spec|: "
          + ', '.join(f'{str(k)[6:]} {v[0]:g}/{v[1]:g}' for k, v in TOL.items()) + '.', '',
          '| version | checks | failed | max abs err by dtype |', '|---|---|---|---|']
    for name, s in res['validation']['summary'].items():
        L.append(f"| {name} | {s['cases']} | {s['failed']} | " + ', '.join(f'{k} {v:.1e}' for k, v in s['max_abs_err'].items()) + ' |')
    cc = res.get('compile_check')
    if cc and 'results' in cc:
        ok = sum(r['ok'] for r in cc['results'])
        L += ['', f"## Compile check (cubin via ptxas, triton {cc['triton']}): {ok}/{len(cc['results'])} compiled", '',
              '| kernel | registers | spill bytes | shared bytes |', '|---|---|---|---|']
        L += [f"| {r['name']} | {r.get('registers')} | {r.get('spill_store_bytes')} | {r.get('shared_bytes')} |" if r['ok']
              else f"| {r['name']} | FAILED: {r['error'][:100]} | | |" for r in cc['results']]
    b = res.get('benchmarks')
    if b:
        L += ['', f"## Decode bandwidth (peak {d.get('peak_gbps')} GB/s)", '', BYTES_FORMULA, '',
              '| model | batch | ctx | impl | µs | GB/s | % peak | max abs err vs torch |', '|---|---|---|---|---|---|---|---|']
        for r in b['decode']:
            L.append(f"| {r['model']} | {r['batch']} | {r['ctx']} | {r['impl']} | {_cell(r, 'us')} | {_cell(r, 'gbps')} | "
                     f"{_cell(r, 'pct_peak')} | {_cell(r, 'max_abs_err_vs_torch')} |")
        L += ['', '## Prefill (llama3-8b heads)', '',
              '| batch | len | cached | impl | µs | TFLOP/s | × SDPA | max abs err vs torch |', '|---|---|---|---|---|---|---|---|']
        for r in b['prefill']:
            L.append(f"| {r['batch']} | {r['seq_len']} | {r['cached']} | {r['impl']} | {_cell(r, 'us')} | {_cell(r, 'tflops')} | "
                     f"{_cell(r, 'x_sdpa')} | {_cell(r, 'max_abs_err_vs_torch')} |")
        if b.get('tune'):
            for k in ('decode', 'multi'):
                best = min((r for r in b['tune'] if r['kernel'] == k), key=lambda r: r['us'], default=None)
                L += ['', f'Tuning, best {k}: `{best}`']
    return '\n'.join(L) + '\n'


def _cell(r, key):
    "A table cell: the value, or why there is none (skipped / error) in the first empty column."
    if r.get(key) is not None: return f'{r[key]:.1e}' if key.startswith('max_abs') else r[key]
    if key in ('us',): return r.get('skipped', r.get('error', ''))
    return ''


def slug(name): return re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')


def main(argv=None):
    ap = argparse.ArgumentParser(description='pagednb kernel lab: validate every paged-attention kernel, then benchmark on a GPU.')
    ap.add_argument('--cases', type=int, default=None, help='random validation cases (default: 200 on a GPU, 16 under the interpreter)')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--quick', action='store_true', help='fewer benchmark shapes and a quick compile check')
    ap.add_argument('--tune', action='store_true', help='GPU: also sweep tile sizes, warps and stages')
    ap.add_argument('--no-bench', action='store_true', help='validation (and compile check) only')
    ap.add_argument('--compile-check', choices=['quick', 'full', 'none'], default='quick',
                    help='CPU: compile every kernel to a cubin for real GPUs (default quick: a representative subset)')
    ap.add_argument('--block-size', type=int, default=16, help='page size for the benchmarks')
    ap.add_argument('--out', default=os.path.join(HERE, 'results'))
    a = ap.parse_args(argv)
    dev = device_info()
    n_cases = a.cases or (200 if GPU else 16)
    note = None
    if not GPU:
        note = (f'No GPU: validation only, through Triton\'s interpreter (TRITON_INTERPRET=1), on {n_cases} small random '
                'shapes (a GPU run uses 200 larger ones), plus the ahead-of-time compile check. The benchmarks need a GPU: '
                'run `python kernels/lab.py` on one.')
        print(note)
    print(f"device: {dev['name']}  versions: {versions()}")
    t0 = time.time()
    rows = validate(n_cases, a.seed, 'cuda' if GPU else 'cpu')
    res = dict(date=datetime.datetime.now().isoformat(timespec='seconds'), device=dev, versions=versions(), note=note,
               validation=dict(cases=n_cases, seed=a.seed, summary=validation_summary(rows), rows=rows,
                               seconds=round(time.time() - t0, 1)))
    if a.compile_check != 'none' and not GPU: res['compile_check'] = compile_check(full=a.compile_check == 'full')
    if GPU and not a.no_bench:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        res['benchmarks'] = dict(dtype=str(dtype), bytes_formula=BYTES_FORMULA,
                                 decode=bench_decode(dtype, a.block_size, a.quick), prefill=bench_prefill(dtype, a.block_size, a.quick))
        if a.tune: res['benchmarks']['tune'] = tune(dtype, a.block_size)
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, slug(dev['name']) if GPU else 'cpu-interpreter')
    with open(base + '.json', 'w') as f: json.dump(res, f, indent=1, default=str)
    with open(base + '.md', 'w') as f: f.write(markdown(res))
    failed = sum(not r['ok'] for r in rows)
    cc_bad = sum(not r['ok'] for r in res.get('compile_check', {}).get('results', []))
    print(f"\n{len(rows) - failed}/{len(rows)} validation checks passed"
          + (f", {cc_bad} kernels failed to compile" if cc_bad else '') + f"; results in {base}.json and .md ({time.time() - t0:.0f} s)")
    return 1 if failed or cc_bad else 0


if __name__ == '__main__': sys.exit(main())
