"""Paged attention: the torch backend and every Triton kernel and variant against the spec.

On a CPU the Triton kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton), so every shape here is small. Tolerances, against the spec computed in float32 from
the same (rounded) inputs, as `|out - spec| <= atol + rtol * |spec|`:

- float32: atol 1e-5, rtol 1e-5 (the interpreter's dot is numpy float32; on a GPU the kernels ask for "ieee");
- float16: atol 2e-3, rtol 2e-3 (the output is rounded to fp16, and the kernels round probabilities to fp16 for P @ V);
- bfloat16: atol 1.6e-2, rtol 1.6e-2 (8 bits of mantissa, same two roundings).
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import pagednb.attention as A
from pagednb.attention import (BACKENDS, TorchAttentionPlan, check_block_tables, contiguous_attention,
                               make_paged_problem, paged_attention, paged_attention_multi, paged_attention_spec,
                               paged_attention_torch, paged_decode, paged_decode_naive, plan_attention, store_kv,
                               trace_pages)

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def spec32(p):
    "The spec, in float32, on the problem's (already rounded) inputs."
    q, kc, vc, bt, sl, qsl, sc = p.args
    return paged_attention_spec(q.float(), kc.float(), vc.float(), bt, sl, qsl, sc, **p.kw)


def assert_matches(out, p):
    assert out.dtype == p.query.dtype and out.shape == p.query.shape
    atol, rtol = TOL[p.query.dtype]
    torch.testing.assert_close(out.float(), spec32(p), atol=atol, rtol=rtol)


def mixed(heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=0):
    "Decode (one of length 1), a full prefill, a prefill over a cached prefix, a speculative-sized query."
    return make_paged_problem([1, 21, 9, 40, 27], query_lens=[1, 1, 9, 13, 4], num_heads=heads, num_kv_heads=kv_heads,
                              head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed).fill()


GQA = [(3, 3), (6, 2), (8, 1)]   # ratios 1, 3, 8
BLOCKS = [8, 16, 64]


# --- the spec and the torch backend ---------------------------------------------------------------------------

@pytest.mark.parametrize('heads,kv_heads', GQA)
@pytest.mark.parametrize('block_size', BLOCKS)
def test_spec_and_torch_match_contiguous_sdpa(heads, kv_heads, block_size):
    p = mixed(heads, kv_heads, 64, block_size)
    truth = contiguous_attention(p)
    torch.testing.assert_close(paged_attention_spec(*p.args), truth, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_attention_torch(*p.args), truth, atol=1e-5, rtol=1e-5)


def test_shared_prefix_blocks():
    p = make_paged_problem([30, 26, 41], query_lens=[1, 5, 11], head_dim=64, block_size=8, shared_prefix=17, seed=3).fill()
    assert (p.block_tables[:, :2] == p.block_tables[0, :2]).all()            # two full blocks shared by all three
    torch.testing.assert_close(paged_attention_torch(*p.args), contiguous_attention(p), atol=1e-5, rtol=1e-5)
    for variant in ('multi',):
        assert_matches(paged_attention(*p.args, backend='triton', variant=variant), p)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 50)), min_size=1, max_size=5),
       st.sampled_from(GQA), st.sampled_from([4, 8, 16, 32]), st.integers(0, 2**16))
def test_torch_backend_random(lens_q, gqa, block_size, seed):
    lens = [max(a, b) for a, b in lens_q]
    qlens = [min(a, b) for a, b in lens_q]
    p = make_paged_problem(lens, query_lens=qlens, num_heads=gqa[0], num_kv_heads=gqa[1], head_dim=16,
                           block_size=block_size, seed=seed).fill()
    out = paged_attention_torch(*p.args)
    assert not out.isnan().any()                                             # NaN in unused slots never leaks
    torch.testing.assert_close(out, contiguous_attention(p), atol=1e-5, rtol=1e-5)


def test_torch_backend_long_prefill_path():
    p = make_paged_problem([60, 45, 5], query_lens=[60, 30, 1], head_dim=64, block_size=16, seed=4).fill()
    assert max(60, 30) > A._PAD_MAX_QUERY                                     # exercises the per-sequence path
    assert_matches(paged_attention_torch(*p.args), p)


# --- store_kv -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_store_kv(backend, dtype):
    ref = make_paged_problem([13, 7, 30], query_lens=[1, 7, 5], num_heads=6, num_kv_heads=3, head_dim=80,
                             block_size=8, dtype=dtype).fill()
    p = make_paged_problem([13, 7, 30], query_lens=[1, 7, 5], num_heads=6, num_kv_heads=3, head_dim=80,
                           block_size=8, dtype=dtype)
    pad = torch.tensor([-1, -1])
    store_kv(torch.cat([p.key, p.key[:2] + 5]), torch.cat([p.value, p.value[:2]]), p.k_cache, p.v_cache,
             torch.cat([p.slot_mapping, pad]), backend=backend)
    assert torch.equal(p.k_cache.nan_to_num(), ref.k_cache.nan_to_num())     # -1 rows were skipped
    assert torch.equal(p.v_cache.nan_to_num(), ref.v_cache.nan_to_num())
    assert_matches(paged_attention(*p.args, backend=backend), p)


# --- every Triton kernel and variant -------------------------------------------------------------------------

@pytest.mark.parametrize('heads,kv_heads', GQA)
@pytest.mark.parametrize('block_size', BLOCKS)
def test_decode_kernels(heads, kv_heads, block_size):
    p = make_paged_problem([1, 19, 70, 33], num_heads=heads, num_kv_heads=kv_heads, head_dim=64,
                           block_size=block_size, seed=block_size + heads).fill()
    assert_matches(paged_decode_naive(*p.args), p)                           # v1
    assert_matches(paged_decode(*p.args, block_n=max(16, block_size)), p)    # v2
    assert_matches(paged_attention_multi(*p.args, max_query_len=1, num_splits=3, block_m=1, block_n=16), p)  # split-K


@pytest.mark.parametrize('heads,kv_heads', GQA)
@pytest.mark.parametrize('block_size', BLOCKS)
def test_multi_token_kernel_mixed_batch(heads, kv_heads, block_size):
    p = mixed(heads, kv_heads, 64, block_size, seed=block_size)
    assert_matches(paged_attention_multi(*p.args, max_query_len=13, block_m=4, block_n=max(16, block_size)), p)


@pytest.mark.parametrize('splits', [2, 5])
def test_multi_token_split_k(splits):
    # more splits than a short sequence has tiles: some parts see no key and must weigh 0
    p = mixed(8, 2, 64, 8, seed=splits)
    assert_matches(paged_attention_multi(*p.args, max_query_len=13, num_splits=splits, block_m=2, block_n=16), p)


@pytest.mark.parametrize('head_dim', [80, 96, 128])
def test_head_dims(head_dim):
    p = make_paged_problem([3, 25], query_lens=[1, 6], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16).fill()
    assert_matches(paged_attention(*p.args, backend='triton'), p)
    d = make_paged_problem([3, 25], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16).fill()
    assert_matches(paged_attention(*d.args, backend='triton', variant='decode'), d)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('backend', BACKENDS)
def test_half_dtypes(dtype, backend):
    p = mixed(6, 2, 64, 16, dtype=dtype, seed=7)
    assert_matches(paged_attention(*p.args, backend=backend), p)
    d = make_paged_problem([5, 40], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype).fill()
    assert_matches(paged_attention(*d.args, backend=backend), d)


def test_dispatch_and_plan():
    assert A.default_backend('cpu') == 'torch' and A.default_backend('cuda') == 'triton'
    p = mixed()
    torch.testing.assert_close(paged_attention(*p.args), paged_attention_torch(*p.args))   # CPU default: torch
    assert_matches(paged_attention(*p.args, backend='triton', max_query_len=13, max_seq_len=40), p)
    assert plan_attention(64, 32, 8, 128, 16, 1, 2048, num_sms=132).variant == 'decode'
    split = plan_attention(2, 32, 8, 128, 16, 1, 8192, num_sms=132)
    assert split.variant == 'decode-split' and split.num_splits > 1
    assert plan_attention(4, 32, 8, 128, 16, 512, 512, num_sms=132).variant == 'multi'
    assert plan_attention(1, 32, 8, 128, 16, 6, 16384, num_sms=132).variant == 'multi-split'
    assert plan_attention(1, 9, 3, 64, 16, 1, 100_000, num_sms=1).num_splits == 1       # the interpreter never splits


def test_trace_split_reads_each_page_once():
    p = make_paged_problem([44, 40, 30], num_heads=2, num_kv_heads=1, head_dim=16, block_size=8, shared_prefix=24, seed=5).fill()
    out, tr = trace_pages(*p.args, max_query_len=1, max_seq_len=44, variant='decode', num_splits=3)
    assert_matches(out, p)
    for s, L in enumerate(p.seq_lens.tolist()):
        read = sorted(b for b in tr[s].flatten().tolist() if b >= 0)
        assert read == sorted(p.block_tables[s, :math.ceil(L / 8)].tolist())
    _, tr1 = trace_pages(*p.args, max_query_len=1, max_seq_len=44, variant='decode', num_splits=1)
    assert tr1.shape[1] == 1 and (tr1[:, 0, 0, :3] == p.block_tables[:, :3]).all()   # shared blocks read by all


def test_empty_batch():
    p = make_paged_problem([5], head_dim=16, block_size=4).fill()
    q = p.query[:0]
    args = (q, p.k_cache, p.v_cache, p.block_tables[:0], p.seq_lens[:0], p.query_start_loc[:1], p.scale)
    for backend in BACKENDS:
        assert paged_attention(*args, backend=backend).shape == (0, 4, 16)
        store_kv(p.key[:0], p.value[:0], p.k_cache, p.v_cache, p.slot_mapping[:0], backend=backend)


# --- bad input ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('backend', BACKENDS)
def test_bad_attention_args(backend):
    p = mixed()
    q, kc, vc, bt, sl, qsl, sc = p.args
    run = lambda *a, **kw: paged_attention(*a, backend=backend, **kw)
    cases = [
        ((q.half(), kc, vc, bt, sl, qsl, sc), 'k_cache has dtype'),
        ((q, kc, vc.double(), bt, sl, qsl, sc), 'v_cache has dtype'),
        ((q.long(), kc, vc, bt, sl, qsl, sc), 'query has dtype'),
        ((q[0], kc, vc, bt, sl, qsl, sc), 'query must have 3 dimensions'),
        ((q, kc[..., :32].contiguous(), vc[..., :32].contiguous(), bt, sl, qsl, sc), 'k_cache head_dim is 32'),
        ((q, kc, vc[:, :8].contiguous(), bt, sl, qsl, sc), 'v_cache has shape'),
        ((q[:, :3].contiguous(), kc, vc, bt, sl, qsl, sc), 'not a multiple'),
        ((q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc, bt, sl, qsl, sc), 'query must be contiguous'),
        ((q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, bt, sl, qsl, sc), 'k_cache must be contiguous'),
        ((q, kc, vc, bt.t().contiguous().t(), sl, qsl, sc), 'block_tables must be contiguous'),
        ((q, kc, vc, bt.float(), sl, qsl, sc), 'block_tables has dtype'),
        ((q, kc, vc, bt[:-1], sl, qsl, sc), 'block_tables has 4 rows'),
        ((q, kc, vc, bt, sl, qsl[:-1], sc), 'query_start_loc must have'),
        ((q, kc, vc, bt, sl.to('meta'), qsl, sc), 'seq_lens is on meta'),
        ((q, kc, vc, bt, sl, qsl, -1.0), 'scale must be'),
        ((q, kc, vc, bt, sl - 9, qsl, sc), 'seq_lens must be at least'),
        ((q, kc, vc, bt, sl + 100, qsl, sc), 'needs'),
        ((q[:-1].contiguous(), kc, vc, bt, sl, qsl, sc), 'query_start_loc[-1]'),
    ]
    for args, msg in cases:
        with pytest.raises((ValueError, TypeError)) as e: run(*args)
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(ValueError, match='backend must be one of'): paged_attention(*p.args, backend='cuda')


@pytest.mark.parametrize('backend', BACKENDS)
def test_block_table_out_of_range(backend):
    p = mixed()
    bad = p.block_tables.clone(); bad[3, 2] = p.k_cache.shape[0]
    with pytest.raises(IndexError, match=r'block_tables\[3, 2\]'):
        paged_attention(p.query, p.k_cache, p.v_cache, bad, p.seq_lens, p.query_start_loc, p.scale, backend=backend, debug=True)
    bad[3, 2] = -3
    with pytest.raises(IndexError, match='out of range'):
        paged_attention(p.query, p.k_cache, p.v_cache, bad, p.seq_lens, p.query_start_loc, p.scale, backend=backend, debug=True)


def test_debug_check_from_environment(monkeypatch):
    p = mixed()
    bad = p.block_tables.clone(); bad[1, 0] = 10_000
    monkeypatch.setenv('PAGEDNB_DEBUG', '1')
    with pytest.raises(IndexError, match='block_tables'):
        paged_attention(p.query, p.k_cache, p.v_cache, bad, p.seq_lens, p.query_start_loc, p.scale, backend='triton')
    assert check_block_tables(p.block_tables, p.seq_lens, p.k_cache.shape[0], 16) is None


@pytest.mark.parametrize('backend', BACKENDS)
def test_bad_store_args(backend):
    p = mixed()
    k, v, kc, vc, sm = p.key, p.value, p.k_cache, p.v_cache, p.slot_mapping
    run = lambda *a: store_kv(*a, backend=backend, debug=True)
    cases = [((k, v.half(), kc, vc, sm), 'value has dtype'), ((k, v, kc.half(), vc, sm), 'v_cache has dtype'),
             ((k, v, kc.int(), vc.int(), sm), 'k_cache has dtype'),
             ((k[:, :1].contiguous(), v, kc, vc, sm), 'value has shape'),
             ((k[:, :1].contiguous(), v[:, :1].contiguous(), kc, vc, sm), 'key rows are'),
             ((k, v, kc, vc, sm[:-1]), 'slot_mapping has'), ((k, v, kc, vc, sm.float()), 'slot_mapping has dtype'),
             ((k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, sm), 'key must be contiguous')]
    for args, msg in cases:
        with pytest.raises((ValueError, TypeError)) as e: run(*args)
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(IndexError, match=r'slot_mapping\[0\]'): run(k, v, kc, vc, sm + kc.shape[0] * kc.shape[1])


def test_triton_refusals(monkeypatch):
    p = mixed()
    with pytest.raises(ValueError, match='block_size a power of two'):
        q = make_paged_problem([5], head_dim=16, block_size=12).fill()
        paged_attention(*q.args, backend='triton')
    with pytest.raises(ValueError, match='decode-only'):
        paged_attention(*p.args, backend='triton', variant='decode')
    with pytest.raises(ValueError, match='variant must be'):
        paged_attention(*p.args, backend='triton', variant='fast')
    monkeypatch.setattr(A, 'INTERPRETED', False)                           # as if imported without TRITON_INTERPRET
    with pytest.raises(RuntimeError, match='TRITON_INTERPRET=1'):
        paged_attention(*p.args, backend='triton')
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda d=None: (7, 5))
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda d=None: 'Tesla T4')
    with pytest.raises(TypeError, match='Tesla T4.*no bfloat16'):
        A.check_triton_device(torch.device('cuda'), torch.bfloat16)
    A.check_triton_device(torch.device('cuda'), torch.float16)               # fp16 on a T4 is fine


# --- sliding windows and soft caps ---------------------------------------------------------------------------
# Windows below, at and above a page; pages before the window are the NaN null block, so reading one shows up as NaN.

def windowed(block_size, window, softcap, seed=0, head_dim=16, heads=4, kv_heads=2, lens=None, qlens=None):
    "A decode, a prefill, chunked prefills and a long chunk (the torch backend's one-sequence path), windowed."
    lens = lens or [70, 9, 45, 60, 3]
    qlens = qlens or [1, 9, 6, 20, 3]
    return make_paged_problem(lens, query_lens=qlens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                              block_size=block_size, sliding_window=window, softcap=softcap, seed=seed).fill()


def test_window_convention_matches_transformers():
    from transformers.masking_utils import sliding_window_overlay, causal_mask_function
    overlay, W = sliding_window_overlay(4), 4
    sees = lambda q, k: causal_mask_function(0, 0, q, k) and overlay(0, 0, q, k)
    hf = torch.tensor([[sees(q, k) for k in range(10)] for q in range(10)])
    test = A.visible(torch.arange(10)[:, None], torch.arange(10)[None, :], W)
    assert torch.equal(hf, test)
    assert test.sum(1).tolist() == [1, 2, 3, 4] + [4] * 6                # W tokens including the query itself


@pytest.mark.parametrize('block_size', [16, 32])
@pytest.mark.parametrize('window_kind', ['below', 'page', 'above', 'huge'])
@pytest.mark.parametrize('softcap', [None, 20.0])
def test_window_spec_and_torch_match_dense(block_size, window_kind, softcap):
    W = dict(below=5, page=block_size, above=2 * block_size + 3, huge=10_000)[window_kind]
    p = windowed(block_size, W, softcap, seed=W)
    dense = contiguous_attention(p)
    assert not dense.isnan().any()
    torch.testing.assert_close(paged_attention_spec(*p.args, **p.kw), dense, atol=1e-5, rtol=1e-5)
    out = paged_attention(*p.args, backend='torch', **p.kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 90)), min_size=1, max_size=6),
       st.sampled_from(GQA), st.sampled_from([8, 16, 32]), st.integers(1, 70), st.sampled_from([None, 5.0, 30.0]),
       st.integers(0, 2**16))
def test_window_torch_random(lens_q, gqa, block_size, window, softcap, seed):
    lens = [max(a, b) for a, b in lens_q]
    qlens = [min(a, b) for a, b in lens_q]
    p = make_paged_problem(lens, query_lens=qlens, num_heads=gqa[0], num_kv_heads=gqa[1], head_dim=16,
                           block_size=block_size, sliding_window=window, softcap=softcap, seed=seed).fill()
    dense = contiguous_attention(p)
    torch.testing.assert_close(paged_attention_spec(*p.args, **p.kw), dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_attention_torch(*p.args, **p.kw), dense, atol=1e-5, rtol=1e-5)


def test_softcap_alone_and_no_window_is_todays_behaviour():
    p = mixed()
    assert torch.equal(paged_attention(*p.args, backend='torch', sliding_window=None, softcap=None),
                       paged_attention(*p.args, backend='torch'))
    capped = paged_attention(*p.args, backend='torch', softcap=2.0)
    torch.testing.assert_close(capped, paged_attention_spec(*p.args, softcap=2.0), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(capped, paged_attention_spec(*p.args), atol=1e-3)


@pytest.mark.parametrize('block_size', [16, 32])
@pytest.mark.parametrize('W', [5, 16, 40])
@pytest.mark.parametrize('softcap', [None, 20.0])
def test_window_triton_matches_dense(block_size, W, softcap):
    p = windowed(block_size, W, softcap, seed=W, lens=[70, 9, 45, 21], qlens=[1, 9, 6, 18])
    out = paged_attention(*p.args, backend='triton', **p.kw)
    torch.testing.assert_close(out, contiguous_attention(p), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('variant,splits', [('naive', None), ('decode', None), ('multi', 3)])
@pytest.mark.parametrize('W', [3, 16, 37])
def test_window_triton_decode_variants(variant, splits, W):
    p = make_paged_problem([70, 33, 9, 1], num_heads=6, num_kv_heads=2, head_dim=16, block_size=16,
                           sliding_window=W, softcap=15.0, seed=W).fill()
    out = paged_attention(*p.args, backend='triton', variant=variant, num_splits=splits, **p.kw)
    torch.testing.assert_close(out, contiguous_attention(p), atol=1e-5, rtol=1e-5)


def test_window_triton_split_multi_token_and_bf16():
    p = windowed(16, 20, 10.0, lens=[80, 30], qlens=[7, 30])
    out = paged_attention(*p.args, backend='triton', variant='multi', num_splits=2, **p.kw)
    torch.testing.assert_close(out, contiguous_attention(p), atol=1e-5, rtol=1e-5)
    pb = make_paged_problem([50, 12], query_lens=[1, 5], head_dim=16, block_size=16, dtype=torch.bfloat16,
                            sliding_window=17, softcap=30.0).fill()
    for backend in BACKENDS:
        assert_matches(paged_attention(*pb.args, backend=backend, **pb.kw), pb)


def test_window_triton_reads_only_window_pages():
    p = make_paged_problem([70, 40], num_heads=2, num_kv_heads=1, head_dim=16, block_size=8, sliding_window=12,
                           seed=5).fill()
    out, tr = trace_pages(*p.args, max_query_len=1, max_seq_len=70, variant='decode', num_splits=1, block_n=8,
                          sliding_window=12)
    torch.testing.assert_close(out, contiguous_attention(p), atol=1e-5, rtol=1e-5)
    # position 69 sees 58..69: pages 7 and 8 of 9; position 39 sees 28..39: pages 3 and 4 of 5
    assert [i for i, b in enumerate(tr[0, 0, 0].tolist()) if b >= 0] == [7, 8]
    assert [i for i, b in enumerate(tr[1, 0, 0].tolist()) if b >= 0] == [3, 4]


def test_window_plan():
    p = windowed(16, 20, None)
    n = p.k_cache.shape[0]
    plan = TorchAttentionPlan(p.block_tables, p.seq_lens, p.query_start_loc, n, 16, p.query.shape[0])
    plan20 = TorchAttentionPlan(p.block_tables, p.seq_lens, p.query_start_loc, n, 16, sliding_window=20)
    dense = contiguous_attention(p)
    for pl in (plan, plan20):                                # a window-less plan serves a windowed layer too
        torch.testing.assert_close(paged_attention(*p.args, backend='torch', plan=pl, sliding_window=20), dense,
                                   atol=1e-5, rtol=1e-5)
    assert plan.for_window(20) is plan.for_window(20) and plan.sliding_window is None
    assert max(g.P for g in plan20.groups) < max(g.P for g in plan.groups)   # pages before the window not gathered
    with pytest.raises(ValueError, match='built for sliding_window=20'):
        paged_attention(*p.args, backend='torch', plan=plan20, sliding_window=8)
    with pytest.raises(ValueError, match='sliding_window=None'):
        paged_attention(*p.args, backend='torch', plan=plan20)
    with pytest.raises(ValueError, match='sliding_window must be'):
        TorchAttentionPlan(p.block_tables, p.seq_lens, p.query_start_loc, n, 16, sliding_window=0)


@pytest.mark.parametrize('backend', BACKENDS)
def test_bad_window_args(backend):
    p = mixed()
    bad = [(dict(sliding_window=0), 'sliding_window must be'), (dict(sliding_window=2.5), 'sliding_window must'),
           (dict(softcap=0.0), 'softcap must be'), (dict(softcap=float('inf')), 'softcap must be')]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg): paged_attention(*p.args, backend=backend, **kw)
