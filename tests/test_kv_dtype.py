"""`kv_cache_dtype`: the store's rounding against torch's casts, the torch path over a quantised cache, and the engine
with a 16-bit cache token-equal to Hugging Face whose cache rounds the same way; fp8's drift is measured and printed."""
import ctypes, math, platform, pytest, torch
from transformers import DynamicCache
from pagednb.attention import (KV_STORAGE_DTYPES, kv_storage_dtype, check_kv_scale, quantize_kv, dequantize_kv,
                               make_paged_problem, paged_attention_torch, store_kv, paged_attention)
from pagednb.runner import PagedAttentionBackend
from pagednb.cpu_attention import cpu_kernel
from pagednb.engine import LLM
from pagednb.sampling import SamplingParams
from pagednb.model import load_model, resolve_model
from helpers import chat_ids

MAX_NEW = 16
SYSTEM = "You are a short, careful assistant for a class on operating systems. Answer in one or two sentences. "
QUESTIONS = ["What is a page table?", "Name two scheduling policies."]
TEXT = ("A computer's memory is divided into pages of a fixed size. When a program asks for memory, the operating "
        "system maps the program's virtual pages onto physical frames, and a table records where each one lives. "
        "Because the pages need not be next to each other, no large block has to be found in one piece, and "
        "memory that one program frees can be handed to another at once. The same idea lets an inference engine "
        "keep the keys and values of many requests in one pool of fixed-size blocks.")

# --- the store's rounding ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(KV_STORAGE_DTYPES))
def test_round_trip_matches_torch_casts(name):
    dt = KV_STORAGE_DTYPES[name]
    big = torch.finfo(dt).max
    x = torch.cat([torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 10,
                   torch.tensor([big * 0.99, big * 1.5, -big * 4, 1e30, -1e30, 0.0, -0.0])])
    stored = quantize_kv(x, dt)
    assert stored.dtype == dt and stored.float().isfinite().all()              # saturates: no inf from finite
    torch.testing.assert_close(dequantize_kv(stored), x.clamp(-big, big).to(dt).float(), rtol=0, atol=0)
    in_range = x.abs() <= big
    torch.testing.assert_close(stored.float()[in_range], x[in_range].to(dt).float(), rtol=0, atol=0)

@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "bfloat16"])
def test_scales_divide_on_store_and_multiply_on_read(name):
    dt, x = KV_STORAGE_DTYPES[name], torch.linspace(-3000, 3000, 101)
    got = dequantize_kv(quantize_kv(x, dt, 8.0), scale=8.0)
    big = torch.finfo(dt).max
    torch.testing.assert_close(got, (x / 8.0).clamp(-big, big).to(dt).float() * 8.0, rtol=0, atol=0)

def test_storage_dtypes_and_bad_names():
    assert kv_storage_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_storage_dtype("fp8", torch.float32) is kv_storage_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is unknown; use one of \('auto', 'float16'"):
        kv_storage_dtype("int8", torch.float32)

@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), None, True])
def test_bad_scales(bad):
    with pytest.raises(ValueError, match="k_scale"): check_kv_scale("k_scale", bad)
    kv = torch.zeros(2, 2, 4, 4, 2, 8)
    with pytest.raises(ValueError, match=r"v_scale\[1\]"): PagedAttentionBackend(kv, 0.1, v_scales=[1.0, bad])
    p = make_paged_problem([5], head_dim=8, block_size=4)
    if bad is not None and not isinstance(bad, bool):
        with pytest.raises(ValueError, match="k_scale"): store_kv(p.key, p.value, p.k_cache, p.v_cache, p.slot_mapping,
                                                                  "torch", k_scale=bad)
        with pytest.raises(ValueError, match="v_scale"): paged_attention(*p.args, backend="torch", v_scale=bad)

# --- the torch path over a quantised cache ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(KV_STORAGE_DTYPES))
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_torch_path_reads_the_quantised_cache(name, scale):
    "A mixed batch (decode, short and long prefill), NaN in unused slots: as attention over a hand-dequantised cache."
    dt = KV_STORAGE_DTYPES[name]
    p = make_paged_problem([13, 30, 40], query_lens=[1, 4, 20], num_heads=6, num_kv_heads=2, head_dim=16,
                           block_size=4, seed=1).fill()
    kq, vq = quantize_kv(p.k_cache, dt, scale), quantize_kv(p.v_cache, dt, 2 * scale)
    q, _, _, bt, sl, qsl, sc = p.args
    got = paged_attention_torch(q, kq, vq, bt, sl, qsl, sc, k_scale=scale, v_scale=2 * scale)
    want = paged_attention_torch(q, dequantize_kv(kq, scale=scale), dequantize_kv(vq, scale=2 * scale), bt, sl, qsl, sc)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("name", ["float16", "fp8_e4m3", "fp8_e5m2"])
def test_store_quantises_into_the_cache(name):
    dt = KV_STORAGE_DTYPES[name]
    p = make_paged_problem([9, 6], query_lens=[1, 6], head_dim=8, block_size=4)
    kc, vc = torch.zeros(p.k_cache.shape, dtype=dt), torch.zeros(p.v_cache.shape, dtype=dt)
    store_kv(p.key * 100, p.value, kc, vc, p.slot_mapping, "torch", k_scale=0.5)
    rows = p.slot_mapping.long()
    torch.testing.assert_close(kc.view(-1, *kc.shape[2:])[rows].float(), quantize_kv(p.key * 100, dt, 0.5).float())
    torch.testing.assert_close(vc.view(-1, *vc.shape[2:])[rows].float(), quantize_kv(p.value, dt).float())

# --- the engine against Hugging Face ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parts(): return load_model()

@pytest.fixture(scope="module")
def prompts(parts):
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    return chat_ids(parts[1], chats)

@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()

class RoundingCache(DynamicCache):
    "Hugging Face's cache, keeping what it stores rounded to `kv_dtype` (then held in the model's dtype)."
    def __init__(self, kv_dtype, **kw):
        super().__init__(**kw)
        self.kv_dtype = kv_dtype
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        r = lambda t: t.to(self.kv_dtype).to(t.dtype)
        return super().update(r(key_states), r(value_states), layer_idx, *args, **kwargs)

def hf_greedy(hf, prompts, eos, kv_dtype=None):
    out = []
    for p in prompts:
        cache = RoundingCache(kv_dtype) if kv_dtype is not None else None
        ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos, cache=cache)
        out.append(ids[0, len(p):].tolist())
    return out

def engine_greedy(parts, prompts, **kw):
    llm = LLM(parts, log=False, **(dict(max_model_len=512, kv_cache_memory_bytes=32 << 20) | kw))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]

def test_auto_matches_plain_hf(parts, prompts, hf):
    llm, got = engine_greedy(parts, prompts)
    assert got == hf_greedy(hf, prompts, parts[1].eos_token_id)
    assert llm.engine.runner.kv_cache.dtype == torch.float32 and llm.get_metrics()["kv_cache_dtype"] == "auto"

@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_cache_matches_rounding_hf(parts, prompts, hf, name):
    dt = KV_STORAGE_DTYPES[name]
    want = hf_greedy(hf, prompts, parts[1].eos_token_id, dt)
    llm, got = engine_greedy(parts, prompts, kv_cache_dtype=name)
    assert got == want
    assert llm.engine.runner.kv_cache.dtype == dt
    assert llm.engine.runner.attn.path == ("cpu" if cpu_kernel() else "torch")     # the C++ kernel reads 16 bits
    m = llm.get_metrics()
    assert (m["kv_cache_dtype"], m["kv_bytes_per_token"]) == (name, 30 * 2 * 3 * 64 * 2)
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want                        # now from cached prefix blocks
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    _, chunked = engine_greedy(parts, prompts, kv_cache_dtype=name, max_num_batched_tokens=16)
    assert chunked == want
    if name != "bfloat16": return
    tight, got = engine_greedy(parts, prompts, kv_cache_dtype=name, max_model_len=96, num_gpu_blocks_override=6)
    assert got == want and tight.get_metrics()["num_preemptions"] > 0             # recomputed into the 16-bit pool
    ngram = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    assert engine_greedy(parts, prompts, kv_cache_dtype=name, speculative_config=ngram)[1] == want

def test_same_bytes_hold_more_tokens(parts):
    block = 30 * 2 * 3 * 64 * 4 * 16                                  # one float32 block of SmolLM2: 720 KiB
    blocks = {d: LLM(parts, log=False, max_model_len=256, kv_cache_memory_bytes=20 * block,
                     kv_cache_dtype=d).engine.block_manager.num_blocks for d in ("auto", "bfloat16", "fp8")}
    assert blocks == dict(auto=20, bfloat16=40, fp8=80)

def test_memory_map_draws_the_smaller_blocks(parts):
    "The memory map of an fp8 engine: four times the blocks of the same bytes, its dtype and block bytes in the title."
    from pagednb.plots import plot_memory_map, plot_kv_dtype_pools
    block = 30 * 2 * 3 * 64 * 4 * 16
    engines = {d: LLM(parts, log=False, max_model_len=128, kv_cache_memory_bytes=8 * block, kv_cache_dtype=d).engine
               for d in ("auto", "fp8")}
    figs = {d: plot_memory_map(e.block_manager, kv_cache_dtype=d, bytes_per_token=e.kv_bytes_per_token)
            for d, e in engines.items()}
    cells = {d: sum(list(t.x).count(None) for t in f.data if t.fill == "toself") for d, f in figs.items()}
    assert cells == dict(auto=8, fp8=32)
    assert figs["fp8"].layout.title.text == ("32 blocks of 16: 0 used, 32 free, 0 cached-free<br>"
                                             "<sup>kv_cache_dtype=fp8: 11,520 B per token, 184,320 B per block</sup>")
    fig = plot_kv_dtype_pools(8 * block, {d: 16 * e.kv_bytes_per_token for d, e in engines.items()})
    assert [t.name for t in fig.data] == ["auto: 8 blocks of 737,280 B", "fp8: 32 blocks of 184,320 B"]

def test_unknown_dtype_lists_the_valid_ones(parts):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp4' is unknown; use one of \('auto', 'float16', "
                                         r"'bfloat16', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\)"):
        LLM(parts, log=False, kv_cache_dtype="fp4")

# --- fp8: measured, not asserted away -----------------------------------------------------------------------

def top1_per_position(parts, ids, name):
    llm = LLM(parts, log=False, max_model_len=512, kv_cache_memory_bytes=32 << 20, kv_cache_dtype=name,
              max_num_batched_tokens=64)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    rows = out.prompt_logprobs[1:]
    assert all(math.isfinite(lp.logprob) for row in rows for lp in row.values())          # no NaN, no inf
    return [next(t for t, lp in row.items() if lp.rank == 1) for row in rows]

def test_fp8_drift_is_measured(parts, capsys):
    ids = parts[1](TEXT)["input_ids"]
    ref = top1_per_position(parts, ids, "auto")
    lines = []
    for name in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        got = top1_per_position(parts, ids, name)
        agree = sum(a == b for a, b in zip(ref, got)) / len(ref)
        lines.append(f"kv_cache_dtype={name}: top-1 agreement with auto over {len(ref)} positions: {agree:.3f}")
    with capsys.disabled(): print("\n" + "\n".join(lines))

# --- Triton (interpreted on a CPU): converts 16- and 8-bit pages in registers ---------------------------------

@pytest.mark.parametrize("name", list(KV_STORAGE_DTYPES))
@pytest.mark.parametrize("variant,query_lens,splits", [("naive", [1, 1], None), ("decode", [1, 1], None),
                                                       ("multi", [1, 5], None), ("multi", [1, 1], 2)])
def test_triton_reads_the_quantised_cache(name, variant, query_lens, splits):
    "Tiny shapes: the Triton store and each kernel over a NaN-poisoned quantised cache, against the torch path."
    from pagednb.attention import HAS_TRITON, INTERPRETED
    if not HAS_TRITON or (not torch.cuda.is_available() and not INTERPRETED): pytest.skip("no runnable Triton")
    dt = KV_STORAGE_DTYPES[name]
    p = make_paged_problem([13, 20], query_lens=query_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                           seed=0).fill()
    q, kc, vc, bt, sl, qsl, sc = p.args
    kq, vq = torch.full(kc.shape, float("nan")).to(dt), torch.full(vc.shape, float("nan")).to(dt)
    rows = kc.view(-1, *kc.shape[2:])
    slots = (~rows.isnan().any(-1).any(-1)).nonzero().squeeze(1)                  # the context's slots only
    store_kv(rows[slots] * 1000, vc.view(-1, *vc.shape[2:])[slots], kq, vq, slots, backend="triton")
    assert kq.view(-1, *kq.shape[2:])[slots].float().isfinite().all()             # saturated, not inf
    got = paged_attention(q, kq, vq, bt, sl, qsl, sc, backend="triton", variant=variant, num_splits=splits)
    torch.testing.assert_close(got, paged_attention(q, kq, vq, bt, sl, qsl, sc, backend="torch"), rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match="k_scale = v_scale = 1.0"):
        paged_attention(q, kq, vq, bt, sl, qsl, sc, backend="triton", k_scale=2.0)

# --- a hybrid model: every KV-cache group in the smaller dtype -------------------------------------------------

def test_hybrid_groups_in_16_bits(tmp_path):
    "Gemma 2 (sliding and full layers in two KV-cache groups, soft caps): bfloat16 cache against rounding HF."
    from helpers import tiny_hybrid_model
    hf = tiny_hybrid_model("gemma2", tmp_path)
    parts = load_model(tmp_path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, hf.config.vocab_size, (n,), generator=g).tolist() for n in (7, 29, 53)]
    want = []
    for p in prompts:
        x = torch.tensor([p])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          pad_token_id=0, cache=RoundingCache(torch.bfloat16, config=hf.config))
        want.append(out[0, len(p):].tolist())
    sp = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    for kw in (dict(), dict(max_num_batched_tokens=16)):
        llm = LLM(parts, log=False, max_model_len=256, kv_cache_dtype="bfloat16", **kw)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
        assert len(llm.engine.kv_groups) == 2 and llm.engine.runner.kv_cache.dtype == torch.bfloat16

# --- the C++ CPU kernel: converts 16- and 8-bit pages in registers ----------------------------------------------

def _cpu_kernel():
    import pagednb.cpu_attention as C
    if C.cpu_kernel() is None: pytest.skip("no C++ compiler: the CPU kernel is unavailable here")
    return C

CPU_SHAPES = [(9, 3, 64, 16), (8, 1, 128, 16), (4, 4, 16, 8), (14, 2, 32, 32)]     # H, kv heads, head_dim, block

@pytest.mark.parametrize("name", list(KV_STORAGE_DTYPES))
@pytest.mark.parametrize("shape", CPU_SHAPES)
def test_cpu_kernel_reads_the_quantised_cache(name, shape):
    "Both kernels (16- and 8-lane) over a NaN-poisoned quantised cache, decodes and prefills, against the torch path."
    C, dt, (H, kvh, D, bs) = _cpu_kernel(), KV_STORAGE_DTYPES[name], shape
    p = make_paged_problem([1, 13, 30, 70], query_lens=[1, 1, 4, 20], num_heads=H, num_kv_heads=kvh, head_dim=D,
                           block_size=bs, seed=D).fill()
    q, kc, vc, bt, sl, qsl, sc = p.args
    for ks, vs in ((1.0, 1.0), (0.25, 3.0)):
        kq, vq = quantize_kv(kc * 4, dt, ks), quantize_kv(vc, dt, vs)           # NaN stays NaN: unused slots
        want = paged_attention_torch(q, kq, vq, bt, sl, qsl, sc, k_scale=ks, v_scale=vs)
        for wide in (True, False):
            got = C.paged_attention_cpu(q, kq, vq, bt, sl, qsl, sc, wide=wide, k_scale=ks, v_scale=vs)
            assert got.isfinite().all()
            torch.testing.assert_close(got, want, rtol=5e-5, atol=5e-5)

@pytest.mark.parametrize("name", list(KV_STORAGE_DTYPES))
def test_cpu_kernel_reads_every_bit_pattern(name):
    "Each stored bit pattern read back as torch casts it (inf, NaN, subnormals; e4m3 NaN aside): one-token sequences."
    C, dt = _cpu_kernel(), KV_STORAGE_DTYPES[name]
    bits = torch.arange(2 ** (8 * dt.itemsize), dtype=torch.int32)
    raw = bits.to(torch.uint8) if dt.itemsize == 1 else bits.to(torch.int16)   # int16 wraps: the same 16 bits
    D = 64
    v = raw.view(dt).view(-1, 1, 1, D)                                          # one token per page
    n = v.shape[0]
    q, k = torch.randn(n, 1, D), torch.zeros(n, 1, 1, D, dtype=dt)
    args = (torch.arange(n, dtype=torch.int32)[:, None], torch.ones(n, dtype=torch.int32),
            torch.arange(n + 1, dtype=torch.int32), D**-0.5)
    want = v.float().view(-1)
    if dt == torch.float8_e4m3fn:                          # its NaN (never stored: the store saturates) reads as +-480
        want[want.isnan()] = torch.where(raw[want.isnan()] >= 128, -480.0, 480.0)
    for wide in (True, False):
        got = C.paged_attention_cpu(q, k, v, *args, wide=wide, v_scale=2.0)
        torch.testing.assert_close(got.view(-1), want * 2.0, rtol=0, atol=0, equal_nan=True)

# --- the C++ store: rows converted to the cache's dtype in registers, bit for bit as the torch store ----------------

CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]

def _values(n=40_000, seed=0):
    "Finite float32s of every exponent (random mantissas and signs), the formats' edges, and values beyond them."
    b = torch.randint(0, 2**32, (n,), generator=torch.Generator().manual_seed(seed))
    b = b[((b >> 23) & 0xff) != 0xff]
    x = (b - (b >= 2**31) * 2**32).to(torch.int32).view(torch.float32)
    edges = torch.tensor([0., 448., 464., 480., 1e4, 57344., 61440., 65504., 65520., 1e30, 3.4e38, 2.**-6, 2.**-9,
                          3 * 2.**-10, 2.**-14, 2.**-17, 2.**-24, 3 * 2.**-26, 2.**-25, 1e-40, 1e-45])
    return torch.cat([x, edges, -edges])

def _bits(t): return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])

def _both_stores(C, x, dt, row, k_scale, v_scale, seed=1):
    "`x` as rows [T, 1, row] (and reversed, as V) stored by the C++ store and by torch's: the four caches."
    x = x[:len(x) // row * row].view(-1, 1, row)
    T = x.shape[0]
    slots = torch.randperm(T + 9, generator=torch.Generator().manual_seed(seed))[:T]
    slots[::5] = -1                                                    # padding: never written
    caches = [torch.zeros(T + 9, 1, 1, row, dtype=dt) for _ in range(4)]
    C.store_kv_cpu(x, x.flip(0), *caches[:2], slots, k_scale=k_scale, v_scale=v_scale)
    store_kv(x, x.flip(0), *caches[2:], slots, "torch", k_scale=k_scale, v_scale=v_scale)
    return caches

STORE_PAIRS = [(src, dt) for src in CACHE_DTYPES[:3] for dt in CACHE_DTYPES if src == dt or dt != torch.float32]

@pytest.mark.parametrize("src,dt", STORE_PAIRS)                          # a cache is never wider than the rows
def test_cpu_store_matches_torch_bit_for_bit(src, dt):
    "Every input dtype into every cache dtype, with and without scales, rows whole vectors and not: the same bits."
    C, x = _cpu_kernel(), _values().to(src)
    x = torch.where(x.isfinite(), x, 0)                              # a 16-bit input cannot hold the largest float32s
    for row, ks, vs in ((16, 1.0, 1.0), (13, 0.1, 3.0), (64, 1 / 3, 2.0**-7), (5, 1e3, 1e-3)):
        kc, vc, kt, vt = _both_stores(C, x, dt, row, ks, vs)
        for a, b in ((kc, kt), (vc, vt)):
            assert a.float().isfinite().all(), f"{src} -> {dt}, scale {ks}: a finite input became inf or NaN"
            mismatch = (_bits(a) != _bits(b)).nonzero()
            assert not len(mismatch), f"{src} -> {dt}, scale {ks}, row {row}: {len(mismatch)} elements differ"

def test_cpu_store_saturates_and_skips_padding():
    C = _cpu_kernel()
    x = torch.tensor([1e30, -3.4e38, 500., -470., 3e5, 65520., 1e-45, 0.]).view(1, 1, 8)
    for dt in CACHE_DTYPES[1:]:
        kc, vc = torch.full((2, 1, 1, 8), float("nan")).to(dt), torch.zeros(2, 1, 1, 8, dtype=dt)
        C.store_kv_cpu(x.repeat(2, 1, 1), x.repeat(2, 1, 1), kc, vc, torch.tensor([1, -1]))
        big = torch.finfo(dt).max
        torch.testing.assert_close(kc[1].float().view(-1), x.clamp(-big, big).to(dt).float().view(-1), rtol=0, atol=0)
        assert kc[1].float().abs().max() == big and kc[0].float().isnan().all()     # slot 0 untouched (-1 skipped)

def test_kernel_step_stores_in_cpp(monkeypatch):
    "The engine's C++ path stores a quantised cache through the C store, never through torch's."
    C = _cpu_kernel()
    p = make_paged_problem([20, 9], query_lens=[1, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8).fill()
    step = C.KernelStep(p.k_cache, *p.args[3:6], p.slot_mapping, p.args[6])
    monkeypatch.setattr(C, "store_kv_torch", lambda *a, **k: pytest.fail("stored through torch"))
    for dt in CACHE_DTYPES:
        kc, vc = torch.zeros(p.k_cache.shape, dtype=dt), torch.zeros(p.v_cache.shape, dtype=dt)
        step.store_kv(p.key, p.value, kc, vc, k_scale=0.5, v_scale=2.0)
        rows = p.slot_mapping.long()
        assert torch.equal(_bits(kc.view(-1, 2, 32)[rows]), _bits(quantize_kv(p.key, dt, 0.5)))
        assert torch.equal(_bits(vc.view(-1, 2, 32)[rows]), _bits(quantize_kv(p.value, dt, 2.0)))

@pytest.mark.skipif(platform.machine() != "x86_64", reason="F16C is an x86 extension")
def test_store_and_read_without_f16c(tmp_path, monkeypatch):
    "The kernel built for a plain x86-64 (no F16C: integer conversions only) stores and reads as torch casts."
    C = _cpu_kernel()
    monkeypatch.setattr(C, "CPU_KERNEL_FLAGS", (["-O0"],))                # plain x86-64: no F16C; -O0 builds in seconds
    lib = ctypes.CDLL(str(C.build_cpu_kernel(cache=tmp_path)))
    for name, (args, res) in C.cpu_kernel.signatures.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
    monkeypatch.setattr(C.cpu_kernel, "_state", dict(lib=lib, error=None))
    x = _values(4000)
    for dt in CACHE_DTYPES:
        kc, vc, kt, vt = _both_stores(C, x, dt, 13, 0.25, 1.0)
        assert torch.equal(_bits(kc), _bits(kt)) and torch.equal(_bits(vc), _bits(vt)), dt
    for dt in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        raw = torch.arange(2 ** (8 * dt.itemsize), dtype=torch.int32)
        v = (raw.to(torch.uint8) if dt.itemsize == 1 else raw.to(torch.int16)).view(dt).view(-1, 1, 1, 64)
        n, ok = v.shape[0], ~v.float().view(-1).isnan()
        args = (torch.arange(n, dtype=torch.int32)[:, None], torch.ones(n, dtype=torch.int32),
                torch.arange(n + 1, dtype=torch.int32), 0.125)
        got = C.paged_attention_cpu(torch.randn(n, 1, 64), torch.zeros(v.shape, dtype=dt), v, *args, wide=False)
        assert torch.equal(got.view(-1)[ok], v.float().view(-1)[ok]), dt

# --- scales: from a checkpoint, or measured (calculate_kv_scales) ------------------------------------------------

def _with_scales(path, scales):
    "Add `scales` ({name: tensor}) to the tiny checkpoint saved in `path`."
    from safetensors.torch import load_file, save_file
    f = path / "model.safetensors"
    save_file({**load_file(f), **scales}, f, metadata={"format": "pt"})

def test_checkpoint_scales_are_read_and_applied(tmp_path):
    "vLLM's names, in a tiny checkpoint: an fp8 engine's layers take them (the C++ path reads scaled caches)."
    from helpers import tiny_hf_model
    tiny_hf_model("llama", tmp_path)
    _with_scales(tmp_path, {"model.layers.0.self_attn.k_scale": torch.tensor(0.0625),
                            "model.layers.1.self_attn.attn.v_scale": torch.tensor([0.03125]),
                            "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(0.125)})
    parts = load_model(tmp_path, dtype="float32", device="cpu")
    assert parts[0].kv_scales == ([0.0625, 0.125], [1.0, 0.03125])
    sp = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    outs = {}
    for name in ("fp8", "bfloat16"):
        llm = LLM(parts, log=False, max_model_len=128, kv_cache_dtype=name)
        outs[name] = llm.generate([[5, 9, 30, 7, 2, 11]], sp, use_tqdm=False)[0].outputs[0].token_ids
        a = llm.engine.runner.attn
        want = ([0.0625, 0.125], [1.0, 0.03125]) if name == "fp8" else ([1.0] * 2, [1.0] * 2)   # 16 bits: unscaled
        assert (a.k_scales, a.v_scales) == want
    assert len(outs["fp8"]) == 8

def test_bfloat16_model_stores_through_cpp(tmp_path, monkeypatch):
    "A model computing in bfloat16 (no C++ attention for it) stores its fp8 cache in C++, token-equal to torch's store."
    from helpers import tiny_hf_model
    import pagednb.runner as R
    tiny_hf_model("llama", tmp_path)
    parts = load_model(tmp_path, dtype="bfloat16", device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    run = lambda: LLM(parts, log=False, max_model_len=128, kv_cache_dtype="fp8").generate(
        [[5, 9, 30, 7, 2, 11], list(range(40, 80))], sp, use_tqdm=False)
    calls, real = [], R.store_kv_cpu
    monkeypatch.setattr(R, "store_kv_cpu", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    got = [o.outputs[0].token_ids for o in run()]
    assert calls and set(calls) == {torch.bfloat16}
    monkeypatch.setattr(R, "cpu_store_supports", lambda *a: False)                  # torch's store instead
    assert [o.outputs[0].token_ids for o in run()] == got

def test_checkpoint_scale_of_the_wrong_shape(tmp_path):
    from helpers import tiny_hf_model
    tiny_hf_model("llama", tmp_path)
    _with_scales(tmp_path, {"model.layers.1.self_attn.v_scale": torch.ones(2)})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.v_scale has shape \(2,\): a KV cache scale is one"):
        load_model(tmp_path, dtype="float32", device="cpu")

def test_calculate_kv_scales_measures_the_first_step(tmp_path):
    "calculate_kv_scales: each layer's largest |K| / 200 and |V| / 100 over the first step (the prompt), as vLLM."
    from helpers import tiny_hf_model
    hf = tiny_hf_model("llama", tmp_path)
    parts = load_model(tmp_path, dtype="float32", device="cpu")
    prompt = [5, 9, 30, 7, 2, 11, 40, 3]
    llm = LLM(parts, log=False, max_model_len=128, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    kv = [(cache.layers[l].keys, cache.layers[l].values) for l in range(2)]        # what each layer stored
    a = llm.engine.runner.attn
    want = [[float(k.abs().amax()) / 200 for k, _ in kv], [float(v.abs().amax()) / 100 for _, v in kv]]
    # layer 0 reads the prompt as HF does; layer 1's input has been through layer 0's fp8 cache already
    assert [a.k_scales[0], a.v_scales[0]] == pytest.approx([want[0][0], want[1][0]], rel=1e-5)
    assert [a.k_scales[1], a.v_scales[1]] == pytest.approx([want[0][1], want[1][1]], rel=2e-2)
    assert not a.measuring
