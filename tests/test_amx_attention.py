"The AMX prompt-attention kernel (04c) against the float32 reference and its torch model; bad input; the runner's use of it."
import random
import pytest, torch
import pagednb.amx_attention as A
from pagednb.attention import make_paged_problem, contiguous_attention, chunk_reference

needs_amx = pytest.mark.skipif(not A.amx_available(), reason="no AMX-BF16 here (CPU, compiler or OS): the kernel is a stub")

def _problem(lens, qlens, H, KVH, D, bs, window=None, seed=0):
    return make_paged_problem(lens, qlens, num_heads=H, num_kv_heads=KVH, head_dim=D, block_size=bs, dtype=torch.bfloat16,
                              seed=seed, sliding_window=window).fill()

@pytest.mark.parametrize("n,L,G,window", [(1, 1, 1, None), (40, 300, 3, None), (40, 300, 3, 64), (130, 130, 2, 5),
                                          (17, 200, 4, 16)])
def test_torch_model_of_the_kernel(n, L, G, window):
    "tiled_attention_torch (the kernel's algorithm: 16-row tiles, 128-key blocks, base 2, P in bfloat16) is attention."
    torch.manual_seed(n)
    q, k, v = torch.randn(n, 2 * G, 64).bfloat16(), torch.randn(L, 2, 64).bfloat16(), torch.randn(L, 2, 64).bfloat16()
    qpos = (L - n + torch.arange(n)).repeat_interleave(G)
    want = chunk_reference(q, k, v, 0.125, window)
    for h in range(2):
        got = A.tiled_attention_torch(A.group_rows(q, h, G), k[:, h], v[:, h], qpos, 0.125, window).view(n, G, 64)
        torch.testing.assert_close(got, want[:, h * G:(h + 1) * G], atol=1e-2, rtol=1e-2)

def test_vnni_and_tile_product():
    a, b = torch.randn(16, 32).bfloat16(), torch.randn(32, 16).bfloat16()
    assert A.vnni(b).shape == (16, 16, 2) and A.vnni(b)[3, 5].tolist() == [b[6, 5].item(), b[7, 5].item()]
    torch.testing.assert_close(A.tile_dpbf16ps(torch.ones(16, 16), a, A.vnni(b)), 1 + a.float() @ b.float())

SHAPES = [  # H, KVH, D, block_size
    (9, 3, 64, 16), (8, 1, 128, 16), (4, 4, 32, 32), (16, 2, 64, 16), (2, 1, 256, 32), (6, 2, 96, 8)]

@needs_amx
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(3))
def test_matches_reference(shape, seed):
    "Random chunk sizes and cached prefixes, pages in random order, NaN in every slot no token wrote."
    H, KVH, D, bs = shape
    rng = random.Random(seed)
    L = rng.choice([1, 17, 128, 129, 700, 1100])
    n = min(L, rng.choice([1, 16, 17, 100, 256, L]))
    window = rng.choice([None, None, 1, 33, 200])
    p = _problem([L], [n], H, KVH, D, bs, window, seed)
    got = A.chunk_attention_amx(p.query, p.k_cache, p.v_cache, p.block_tables[0], L, p.scale, window)
    assert got.dtype == torch.float32 and got.shape == (n, H, D) and not got.isnan().any()
    torch.testing.assert_close(got, contiguous_attention(p).float(), atol=1.5e-2, rtol=1e-2)

@needs_amx
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_agree_with_the_torch_model(threads):
    "Any thread count gives the same numbers; they match the torch model of the algorithm closely."
    p = _problem([900], [300], 9, 3, 64, 16, seed=7)
    got = A.chunk_attention_amx(p.query, p.k_cache, p.v_cache, p.block_tables[0], 900, p.scale, threads=threads)
    one = A.chunk_attention_amx(p.query, p.k_cache, p.v_cache, p.block_tables[0], 900, p.scale, threads=1)
    assert torch.equal(got, one)
    k, v = p.k_seqs[0], p.v_seqs[0]
    qpos = (600 + torch.arange(300)).repeat_interleave(3)
    model = torch.stack([A.tiled_attention_torch(A.group_rows(p.query, h, 3), k[:, h], v[:, h], qpos, p.scale).view(300, 3, 64)
                         for h in range(3)], 1).view(300, 9, 64)
    torch.testing.assert_close(got, model, atol=3e-3, rtol=3e-3)

@needs_amx
def test_several_prompts_into_one_output():
    p = _problem([90, 300, 80], [30, 40, 64], 9, 3, 64, 16, seed=2)
    qsl = p.query_start_loc.tolist()
    long = [(s, int(p.seq_lens[s]), qsl[s], qsl[s + 1]) for s in range(3)]
    out = A.paged_prompts_amx(torch.empty_like(p.query), *p.args[:4], long, p.scale)
    torch.testing.assert_close(out.float(), contiguous_attention(p).float(), atol=1.5e-2, rtol=1e-2)
    wide = A.paged_prompts_amx(torch.empty(p.query.shape), *p.args[:4], long, p.scale)        # float32 rows
    assert torch.equal(out, wide.bfloat16())                  # the kernel's bfloat16 rows: its float32 rounded once
    cols = torch.empty(9, p.query.shape[0], 64).bfloat16().transpose(0, 1)                     # not contiguous
    assert torch.equal(A.paged_prompts_amx(cols, *p.args[:4], long, p.scale), out)

def test_supports():
    q, kc = torch.zeros(5, 9, 64).bfloat16(), torch.zeros(4, 16, 3, 64).bfloat16()
    assert A.amx_supports(q, kc) == A.amx_available()
    assert not A.amx_supports(q.float(), kc.float())                       # float32: 04a's kernel
    assert not A.amx_supports(q.half(), kc.half())                         # float16: no tile instruction for it here
    assert not A.amx_supports(q, kc.to(torch.float8_e4m3fn))               # fp8 cache: SDPA dequantises
    assert not A.amx_supports(q, kc, softcap=50.0)
    assert not A.amx_supports(q, kc, k_scale=0.5)
    assert not A.amx_supports(q[..., :48], kc[..., :48])                   # head_dim 48
    assert not A.amx_supports(torch.zeros(5, 8, 64).bfloat16(), kc)        # 8 query heads over 3 kv heads

@needs_amx
def test_bad_input_names_the_argument():
    p = _problem([64], [20], 9, 3, 64, 16)
    bt, call = p.block_tables[0], lambda **kw: A.chunk_attention_amx(**{**dict(
        query=p.query, k_cache=p.k_cache, v_cache=p.v_cache, block_table=bt, seq_len=64, scale=p.scale), **kw})
    with pytest.raises(ValueError, match="block_table must be one row of at least 5 block ids for seq_len=65"): call(seq_len=65)
    with pytest.raises(ValueError, match="block_table must be one row"): call(block_table=p.block_tables)
    with pytest.raises(ValueError, match="seq_len=10 must be at least the 20 query tokens"): call(seq_len=10)
    with pytest.raises(ValueError, match="v_cache .* must match k_cache"): call(v_cache=p.v_cache[:, :8])
    with pytest.raises(ValueError, match="v_cache .* must match k_cache"): call(v_cache=p.v_cache.half())
    with pytest.raises(ValueError, match="block_table holds ids outside the cache's"): call(block_table=bt + p.k_cache.shape[0])
    with pytest.raises(ValueError, match="block_table holds ids outside"): call(block_table=bt - 100)
    with pytest.raises(ValueError, match="sliding_window"): call(sliding_window=0)
    with pytest.raises(ValueError, match="AMX kernel takes bfloat16 query and cache.*got torch.float32"):
        call(query=p.query.float(), k_cache=p.k_cache.float(), v_cache=p.v_cache.float())

def test_switched_off(monkeypatch):
    monkeypatch.setenv("PAGEDNB_AMX_KERNEL", "0")
    q, kc = torch.zeros(5, 9, 64).bfloat16(), torch.zeros(4, 16, 3, 64).bfloat16()
    assert not A.amx_available() and not A.amx_supports(q, kc)
    with pytest.raises(RuntimeError, match="PAGEDNB_AMX_KERNEL=0.*torch backend"):
        A.chunk_attention_amx(q, kc, kc, torch.arange(4), 64, 0.125)

@needs_amx
def test_engine_prompts_on_tiles_same_choices_as_sdpa(monkeypatch):
    "The embedded model in bfloat16: every layer's prompt goes to the kernel; next-token choices as with SDPA."
    from pagednb.engine import LLM
    from pagednb.model import load_model
    from pagednb.sampling import SamplingParams
    parts = load_model(dtype="bfloat16")
    text = "A page table maps the blocks of a sequence to the physical pages of the KV cache, so that " * 4
    ids = parts[1](text)["input_ids"]
    sp = SamplingParams(max_tokens=1, prompt_logprobs=1)
    calls, real = [], A.chunk_attention_amx
    monkeypatch.setattr(A, "chunk_attention_amx", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    def rows(amx):
        monkeypatch.setenv("PAGEDNB_AMX_KERNEL", "1" if amx else "0")
        llm = LLM(parts, log=False, num_gpu_blocks_override=64, max_model_len=256, enable_prefix_caching=False)
        return llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].prompt_logprobs[1:]
    tiles = rows(True)
    assert calls == [len(ids)] * parts[0].config.num_hidden_layers           # one prompt, every layer, once
    sdpa = rows(False)
    assert len(calls) == parts[0].config.num_hidden_layers                   # switched off: none
    top = [[next(t for t, lp in r.items() if lp.rank == 1) for r in rs] for rs in (tiles, sdpa)]
    assert sum(a == b for a, b in zip(*top)) / len(top[0]) >= 0.95
    lp = [[r[t].logprob for r, t in zip(rs, ids[1:])] for rs in (tiles, sdpa)]
    assert abs(sum(lp[0]) / sum(lp[1]) - 1) < 0.01                          # the text's log-likelihood within 1%
