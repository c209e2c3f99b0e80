"The fused CPU ops against torch, `fuse_for_cpu` against the unfused model (and Hugging Face), idempotence, the switch, and a failed build."
import warnings
import pytest, torch
import torch.nn as nn, torch.nn.functional as F
import pagednb.cpu_ops as O
import pagednb.cpu_attention as C
from pagednb.model import load_model, Rotary, RMSNorm, NoCacheAttention, greedy_generate
from pagednb.engine import LLM
from pagednb.cpu_ops import pack_linears, PackedLinear
from pagednb.sampling import SamplingParams
from helpers import tiny_hf_model, FAMILIES

pytestmark = pytest.mark.skipif(O.cpu_ops() is None, reason="no C++ compiler: the fused CPU ops are unavailable here")

def rms_ref(x, w, eps): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    n = torch.get_num_threads(); torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(n)

SHAPES = [(1, 576), (64, 576), (3, 13), (7, 1), (2, 5, 100), (600, 1536), (33, 9)]

@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, threads):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x, w = torch.randn(shape, generator=g) * 4, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(O.rms_norm(x, w, 1e-5), rms_ref(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    ref = rms_ref(x, w, 1e-6)
    O.rms_norm(x, w, out=x)                                          # in place
    torch.testing.assert_close(x, ref, atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(shape, threads):
    g = torch.Generator().manual_seed(shape[-1])
    x, r, w = torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape[-1], generator=g)
    total = x + r
    out, res = O.fused_add_rms_norm(x, r, w, 1e-5)
    assert out is x and res is r
    torch.testing.assert_close(r, total, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x, rms_ref(total, w, 1e-5), atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize("shape", [(1, 16), (64, 3072), (3, 26), (5, 2), (2, 3, 74), (300, 3000)])
def test_silu_mul(shape, threads):
    gu = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 10
    g, u = gu.chunk(2, -1)
    torch.testing.assert_close(O.silu_mul(gu), F.silu(g) * u, atol=1e-5, rtol=1e-5)

def test_silu_whole_range():
    gate = torch.cat([torch.linspace(-150, 150, 30001), torch.tensor([-1e38, -3e4, -89.5, -88.7, 88.7, 89.5, 3e4, 1e38, 0.0, -0.0])])
    out = O.silu_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    torch.testing.assert_close(out, F.silu(gate), atol=1e-30, rtol=2e-6)
    assert not out.isnan().any() and not out.isinf().any()
    assert O.silu_mul(torch.tensor([[float("nan"), 1.0]])).isnan().all()

@pytest.mark.parametrize("I", [1, 8, 16, 27, 1536])
def test_silu_mul_bf16_is_torchs(I, threads):
    "bfloat16 rows (16 values a step with AVX-512, then 8, then one at a time) give torch's values bit for bit."
    g = torch.Generator().manual_seed(I)
    gu = (torch.randn(33, 2 * I, generator=g) * 10).bfloat16()
    gu[0, :I] = torch.linspace(-150, 150, I).bfloat16() if I > 1 else 88.7
    gate, up = gu.chunk(2, -1)
    assert torch.equal(O.silu_mul(gu), F.silu(gate) * up)

@pytest.mark.parametrize("shape", [(1, 9, 3, 64), (37, 9, 3, 64), (5, 4, 2, 20), (3, 2, 1, 128), (64, 8, 8, 16), (200, 14, 2, 64), (4, 3, 3, 6)])
@pytest.mark.parametrize("scaling", [None, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)])
def test_rope(shape, scaling, threads):
    T, H, KVH, D = shape
    g = torch.Generator().manual_seed(T * D)
    rot, qkv = Rotary(D, 512, 10000.0, scaling), torch.randn(T, (H + 2 * KVH) * D, generator=g)
    pos = torch.randint(0, 512, (T,), generator=g)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], -1)
    rq, rk = rot(pos, q.reshape(T, H, D), k.reshape(T, KVH, D))
    fq, fk, fv = O.split_qkv_rope(qkv, pos, rot.cos, rot.sin, H, KVH)
    torch.testing.assert_close(fq, rq, atol=1e-5, rtol=1e-5); torch.testing.assert_close(fk, rk, atol=1e-5, rtol=1e-5)
    assert torch.equal(fv, v.reshape(T, KVH, D)) and fq.is_contiguous() and fk.is_contiguous() and fv.is_contiguous()
    view = qkv.view(T, H + 2 * KVH, D)
    O.rope_(view[:, :H], view[:, H:H + KVH], pos.int(), rot.cos, rot.sin)
    torch.testing.assert_close(view[:, :H], rq, atol=1e-5, rtol=1e-5); torch.testing.assert_close(view[:, H:H + KVH], rk, atol=1e-5, rtol=1e-5)
    assert torch.equal(view[:, H + KVH:], v.reshape(T, KVH, D))      # v untouched

def test_threads_agree():
    x, w = torch.randn(300, 576), torch.randn(576)
    gu, qkv, pos, rot = torch.randn(300, 3072), torch.randn(300, 960), torch.arange(300), Rotary(64, 512)
    n, outs = torch.get_num_threads(), []
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            outs.append((O.rms_norm(x, w), O.silu_mul(gu), *O.split_qkv_rope(qkv, pos, rot.cos, rot.sin, 9, 3)))
    finally: torch.set_num_threads(n)
    for a, b in zip(*outs): assert torch.equal(a, b)                 # each row is computed by one thread, in one order

def test_bad_input():
    rot = Rotary(64, 128)
    with pytest.raises(TypeError, match="x has dtype torch.float64"): O.rms_norm(torch.randn(2, 8).double(), torch.ones(8))
    with pytest.raises(ValueError, match="weight has shape"): O.rms_norm(torch.randn(2, 8), torch.ones(7))
    with pytest.raises(ValueError, match="x must be contiguous"): O.rms_norm(torch.randn(8, 2).t(), torch.ones(8))
    with pytest.raises(TypeError, match="must be a torch.Tensor"): O.rms_norm([1.0, 2.0], torch.ones(2))
    with pytest.raises(ValueError, match="residual has shape"): O.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8))
    with pytest.raises(ValueError, match="different tensors"): x = torch.randn(2, 8); O.fused_add_rms_norm(x, x, torch.ones(8))
    with pytest.raises(ValueError, match="even"): O.silu_mul(torch.randn(3, 7))
    with pytest.raises(TypeError, match="gate_up has dtype torch.float16; the fused CPU ops take float32 or bfloat16"): O.silu_mul(torch.randn(3, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="weight has dtype torch.float32; the fused CPU ops take torch.bfloat16"): O.rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(8))
    with pytest.raises(TypeError, match="cos has dtype torch.bfloat16"): O.split_qkv_rope(torch.randn(3, 15 * 64), torch.arange(3), rot.cos.bfloat16(), rot.sin, 9, 3)
    with pytest.raises(ValueError, match="out has shape"): O.silu_mul(torch.randn(3, 8), out=torch.empty(3, 8))
    qkv = torch.randn(3, 15 * 64)
    with pytest.raises(IndexError, match=r"positions\[2\] = 128 is outside the RoPE table of 128"):
        O.split_qkv_rope(qkv, torch.tensor([0, 5, 128]), rot.cos, rot.sin, 9, 3)
    with pytest.raises(IndexError, match=r"positions\[0\] = -1"): O.split_qkv_rope(qkv, torch.tensor([-1, 5, 1]), rot.cos, rot.sin, 9, 3)
    with pytest.raises(ValueError, match="positions has shape"): O.split_qkv_rope(qkv, torch.arange(4), rot.cos, rot.sin, 9, 3)
    with pytest.raises(TypeError, match="positions must be"): O.split_qkv_rope(qkv, torch.arange(3.0), rot.cos, rot.sin, 9, 3)
    with pytest.raises(ValueError, match="qkv must be"): O.split_qkv_rope(qkv, torch.arange(3), rot.cos, rot.sin, 7, 3)
    with pytest.raises(ValueError, match="cos has shape"): O.split_qkv_rope(torch.randn(3, 15 * 32), torch.arange(3), rot.cos, rot.sin, 9, 3)
    q = torch.randn(3, 64, 9).transpose(1, 2)
    with pytest.raises(ValueError, match="heads contiguous"): O.rope_(q, torch.randn(3, 3, 64), torch.arange(3), rot.cos, rot.sin)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU tensors"): O.rms_norm(torch.randn(2, 8, device="cuda"), torch.ones(8, device="cuda"))

# --- the fused model

def logits(model, ids, pos, lens):
    with torch.inference_mode(): return model.compute_logits(model(ids, pos, NoCacheAttention(lens)))

def batch(vocab=256, lens=(3, 40, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (sum(lens),), generator=g), torch.cat([torch.arange(n) for n in lens]), list(lens)

def param_bytes(m): return sum(p.nbytes for p in {id(p): p for p in m.parameters()}.values())

@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("packed_first", [False, True])
def test_fuse_same_logits(family, packed_first, tmp_path):
    tiny_hf_model(family, tmp_path)
    model, _, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    ids, pos, lens = batch()
    ref, size = logits(model, ids, pos, lens), param_bytes(model)
    if packed_first: pack_linears(model)                             # already packed: fusing reads the weights back and packs the merged ones
    assert O.fuse_for_cpu(model) == cfg.num_hidden_layers
    layer = model.model.layers[0]
    assert type(layer) is O.FusedDecoderLayer and type(model.model.norm) is O.FusedRMSNorm
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) == packed_first
    if cfg.attention_bias: assert layer.self_attn.qkv_proj.bias.shape == ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim,)
    torch.testing.assert_close(logits(model, ids, pos, lens), ref, atol=1e-4, rtol=1e-4)
    if not packed_first: assert param_bytes(model) == size        # the merged weights replace the separate ones
    assert O.fuse_for_cpu(model) == 0                                # idempotent
    pack_linears(model)
    torch.testing.assert_close(logits(model, ids, pos, lens), ref, atol=1e-4, rtol=1e-4)

def test_fused_matches_hf_and_greedy(tmp_path):
    hf = tiny_hf_model("llama3", tmp_path)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    before = greedy_generate(model, prompts, 16)
    O.fuse_for_cpu(model)
    x = torch.randint(0, 256, (37,), generator=g)
    with torch.inference_mode(): ref = hf(x[None]).logits[0]
    torch.testing.assert_close(logits(model, x, torch.arange(37), [37]), ref, atol=1e-4, rtol=1e-4)
    assert greedy_generate(model, prompts, 16) == before               # contiguous cache
    assert greedy_generate(model, prompts, 16, use_cache=False) == before   # no cache

def test_engine_fuses_once_and_model_still_works(tmp_path, monkeypatch):
    tiny_hf_model("qwen2", tmp_path)
    parts = load_model(tmp_path, dtype="float32", device="cpu")
    ids, pos, lens = batch()
    ref = logits(parts[0], ids, pos, lens)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 30, 12, 60)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    unfused_parts = load_model(tmp_path, dtype="float32", device="cpu")
    with monkeypatch.context() as m:
        m.setenv("PAGEDNB_CPU_OPS", "0")
        plain = LLM(unfused_parts, log=False, num_gpu_blocks_override=64, max_model_len=128)
        assert plain.engine.runner.fused == 0 and type(unfused_parts[0].model.layers[0]).__name__ == "DecoderLayer"
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    first = LLM(parts, log=False, num_gpu_blocks_override=64, max_model_len=128)
    assert first.engine.runner.fused == 2
    assert first.engine.runner.packed == 0                           # every tiny weight is under PACK_MIN_NUMEL
    second = LLM(parts, log=False, num_gpu_blocks_override=64, max_model_len=128)     # the same model object, already fused
    assert second.engine.runner.fused == 0 and second.engine.runner.packed == 0
    for llm in (first, second):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    torch.testing.assert_close(logits(parts[0], ids, pos, lens), ref, atol=1e-4, rtol=1e-4)   # direct use afterwards

def test_autograd_and_other_dtypes_take_the_torch_path(tmp_path):
    tiny_hf_model("llama", tmp_path)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    ids, pos, lens = batch()
    ref = logits(model, ids, pos, lens)
    O.fuse_for_cpu(model)
    model.requires_grad_(True)
    out = model.compute_logits(model(ids, pos, NoCacheAttention(lens)))
    out.sum().backward()                                             # autograd on: the torch ops, which record it
    assert model.model.layers[0].self_attn.qkv_proj.weight.grad is not None
    torch.testing.assert_close(out.detach(), ref, atol=1e-4, rtol=1e-4)
    model.requires_grad_(False).double()
    torch.testing.assert_close(logits(model, ids, pos, lens), ref, atol=1e-4, rtol=1e-4)   # float64 weights: the torch path

def test_not_fused_off_the_fast_path(tmp_path):
    tiny_hf_model("llama", tmp_path)
    f16, _, _ = load_model(tmp_path, dtype="float16", device="cpu")
    assert O.fuse_for_cpu(f16) == 0 and type(f16.model.layers[0]).__name__ == "DecoderLayer"

# --- bfloat16 rows: computed in float32, rounded where torch's ops round

def bf16_like_torch(got, want):
    "The C++ op's bfloat16 values are torch's: all within one bfloat16 step, nearly all bit for bit."
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got, want)                             # bfloat16's tolerance: rtol 1.6e-2
    assert (got == want).float().mean() >= 0.999

@pytest.mark.parametrize("shape", SHAPES)
def test_ops_in_bfloat16(shape, threads):
    g = torch.Generator().manual_seed(shape[-1] + 7)
    x, r = (torch.randn(shape, generator=g) * 4).bfloat16(), torch.randn(shape, generator=g).bfloat16()
    norm = RMSNorm(shape[-1], 1e-5)
    nn.init.normal_(norm.weight, 1.0, 0.3, generator=g)
    norm = norm.bfloat16().requires_grad_(False)
    bf16_like_torch(O.rms_norm(x, norm.weight, 1e-5), norm(x))
    x2, r2 = x.clone(), r.clone()
    O.fused_add_rms_norm(x2, r2, norm.weight, 1e-5)
    bf16_like_torch(r2, x + r)
    bf16_like_torch(x2, norm(x + r))
    gu = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 6).bfloat16()
    gate, up = gu.chunk(2, -1)
    bf16_like_torch(O.silu_mul(gu), F.silu(gate) * up)

@pytest.mark.parametrize("shape", [(1, 9, 3, 64), (37, 9, 3, 64), (5, 4, 2, 20), (4, 3, 3, 6)])
def test_rope_in_bfloat16(shape):
    T, H, KVH, D = shape
    g = torch.Generator().manual_seed(T * D + 1)
    rot, qkv = Rotary(D, 512), torch.randn(T, (H + 2 * KVH) * D, generator=g).bfloat16()
    pos = torch.randint(0, 512, (T,), generator=g)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], -1)
    rq, rk = rot(pos, q.reshape(T, H, D), k.reshape(T, KVH, D))
    fq, fk, fv = O.split_qkv_rope(qkv, pos, rot.cos, rot.sin, H, KVH)
    bf16_like_torch(fq, rq)
    bf16_like_torch(fk, rk)
    assert torch.equal(fv, v.reshape(T, KVH, D))

@pytest.mark.parametrize("family", list(FAMILIES))
def test_fuse_same_logits_in_bfloat16(family, tmp_path):
    tiny_hf_model(family, tmp_path)
    model, _, cfg = load_model(tmp_path, dtype="bfloat16", device="cpu")
    ids, pos, lens = batch()
    ref = logits(model, ids, pos, lens)
    assert O.fuse_for_cpu(model) == cfg.num_hidden_layers
    assert type(model.model.layers[0]) is O.FusedDecoderLayer
    got = logits(model, ids, pos, lens)
    torch.testing.assert_close(got, ref)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))

def test_engine_fuses_bfloat16(tmp_path, monkeypatch):
    "A bfloat16 engine on the CPU fuses its layers and decodes the tokens its unfused twin decodes."
    tiny_hf_model("qwen3", tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 30, 12, 60)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="bfloat16", log=False, num_gpu_blocks_override=64, max_model_len=128)
    with monkeypatch.context() as m:
        m.setenv("PAGEDNB_CPU_OPS", "0")
        plain = LLM(str(tmp_path), **kw)
        assert plain.engine.runner.fused == 0
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    fused = LLM(str(tmp_path), **kw)
    assert fused.engine.runner.fused == 2
    assert [o.outputs[0].token_ids for o in fused.generate(prompts, sp, use_tqdm=False)] == want

def test_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDNB_CPU_OPS", "0")
    assert O.cpu_ops() is None
    tiny_hf_model("llama", tmp_path)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    assert O.fuse_for_cpu(model) == 0 and type(model.model.layers[0]).__name__ == "DecoderLayer"
    with pytest.raises(RuntimeError, match="PAGEDNB_CPU_OPS=0"): O.rms_norm(torch.randn(2, 8), torch.ones(8))

def test_build_failure_falls_back(tmp_path, monkeypatch):
    "A compiler that fails: a clear error from the build, one warning, nothing fused, and a model fused earlier still right."
    with pytest.raises(RuntimeError, match="could not compile the CPU kernel cpu_ops"):
        C.build_cpu_kernel("cpu_ops.cpp", cache=tmp_path, cxx="/bin/false")
    tiny_hf_model("llama", tmp_path/"m")
    fused, _, _ = load_model(tmp_path/"m", dtype="float32", device="cpu")
    ids, pos, lens = batch()
    ref = logits(fused, ids, pos, lens)
    O.fuse_for_cpu(fused)
    monkeypatch.setattr(O.cpu_ops, "_state", {})
    monkeypatch.setenv("PAGEDNB_CACHE", str(tmp_path/"cache")); monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setattr(C, "find_cxx", lambda: "/bin/false")
    with pytest.warns(UserWarning, match="fused CPU ops are unavailable"): assert O.cpu_ops() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert O.cpu_ops() is None                                   # one warning, not one per call
    model, _, _ = load_model(tmp_path/"m", dtype="float32", device="cpu")
    assert O.fuse_for_cpu(model) == 0
    with pytest.raises(RuntimeError, match="unavailable"): O.silu_mul(torch.randn(2, 8))
    torch.testing.assert_close(logits(fused, ids, pos, lens), ref, atol=1e-4, rtol=1e-4)   # the torch path

def test_default_dtype_does_not_leak_in(tmp_path):
    "Buffers the fast path allocates are float32 whatever torch's default dtype is."
    tiny_hf_model("llama", tmp_path)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    ids, pos, lens = batch()
    ref = logits(model, ids, pos, lens)
    O.fuse_for_cpu(model)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        torch.testing.assert_close(logits(model, ids, pos, lens), ref, atol=1e-4, rtol=1e-4)
        assert O.silu_mul(torch.randn(2, 8, dtype=torch.float32)).dtype == torch.float32
    finally: torch.set_default_dtype(old)

# --- Qwen3: per-head q/k RMSNorm before RoPE, in the same C++ pass

@pytest.mark.parametrize("shape", [(1, 16, 8, 128), (37, 4, 2, 32), (5, 3, 1, 24), (200, 14, 2, 64), (4, 3, 3, 6)])
def test_split_qkv_rope_with_qk_norm(shape, threads):
    from pagednb.model import RMSNorm
    T, H, KVH, D = shape
    g = torch.Generator().manual_seed(T + D)
    rot, qkv = Rotary(D, 512, 1e6), torch.randn(T, (H + 2 * KVH) * D, generator=g) * 5
    pos = torch.randint(0, 512, (T,), generator=g)
    qn, kn = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
    with torch.no_grad():
        for n in (qn, kn): n.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], -1)
        rq, rk = rot(pos, qn(q.reshape(T, H, D)), kn(k.reshape(T, KVH, D)))
    fq, fk, fv = O.split_qkv_rope(qkv, pos, rot.cos, rot.sin, H, KVH, qn.weight.detach(), kn.weight.detach(), 1e-6)
    torch.testing.assert_close(fq, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fk, rk, atol=1e-5, rtol=1e-5)
    assert torch.equal(fv, v.reshape(T, KVH, D))
    with pytest.raises(ValueError, match="both q_weight and k_weight"): O.split_qkv_rope(qkv, pos, rot.cos, rot.sin, H, KVH, qn.weight)
    with pytest.raises(ValueError, match="k_weight has shape"):
        O.split_qkv_rope(qkv, pos, rot.cos, rot.sin, H, KVH, qn.weight.detach(), torch.ones(D + 2))
    with pytest.raises(TypeError, match="q_weight has dtype"):
        O.split_qkv_rope(qkv, pos, rot.cos, rot.sin, H, KVH, qn.weight.detach().double(), kn.weight.detach())

@pytest.mark.parametrize("family", ["qwen3", "qwen3_tied"])
def test_fused_qwen3_matches_hf_and_greedy(family, tmp_path):
    hf = tiny_hf_model(family, tmp_path)
    model, _, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    before = greedy_generate(model, prompts, 16)
    assert O.fuse_for_cpu(model) == cfg.num_hidden_layers
    a = model.model.layers[0].self_attn
    assert type(a) is O.FusedAttention and a.q_norm.weight.shape == (cfg.head_dim,) and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    x = torch.randint(0, 256, (37,), generator=g)
    with torch.inference_mode(): ref = hf(x[None]).logits[0]
    torch.testing.assert_close(logits(model, x, torch.arange(37), [37]), ref, atol=1e-4, rtol=1e-4)
    assert greedy_generate(model, prompts, 16) == before
    for p, o in zip(prompts, before):
        t = torch.tensor([p])
        want = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        assert o == want[0, len(p):].tolist()
    model.requires_grad_(True)                                       # autograd: the torch path applies the norms too
    out = model.compute_logits(model(x, torch.arange(37), NoCacheAttention([37])))
    torch.testing.assert_close(out.detach(), ref, atol=1e-4, rtol=1e-4)

# --- 16-bit products (`matmul_dtype`)

BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()

@pytest.mark.skipif(not BF16, reason="this CPU has no bfloat16 products (AVX512-BF16 or AMX)")
def test_packed_linear_in_bfloat16():
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(576, 960, bias=True)
    x = torch.randn(37, 576, generator=g)
    pl = PackedLinear(lin, matmul_dtype=torch.bfloat16)
    with torch.inference_mode(): y, ref = pl(x), lin(x)
    assert y.dtype == torch.float32 and pl.weight.dtype == torch.float32 and y.shape == ref.shape
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 1e-2                                         # rounded to 8 bits of mantissa, not wrong
    x16 = x.bfloat16().float()                                       # inputs already bfloat16: only the output rounds
    with torch.inference_mode(): exact = F.linear(x16.double(), lin.weight.bfloat16().double(), lin.bias.double())
    torch.testing.assert_close(pl(x16).double(), exact, atol=2e-2, rtol=8e-3)

@pytest.mark.skipif(not BF16, reason="this CPU has no bfloat16 products (AVX512-BF16 or AMX)")
def test_engine_with_bfloat16_products():
    "The embedded model with 16-bit products: every packed layer in bfloat16, next-token choices as float32's."
    parts = load_model()                                  # one model, packed again for each engine
    text = "A page table maps the blocks of a sequence to the physical pages of the KV cache, so that " * 4
    ids = parts[1](text)["input_ids"]
    sp = SamplingParams(max_tokens=1, prompt_logprobs=1)
    def rows(matmul_dtype):
        llm = LLM(parts, log=False, num_gpu_blocks_override=64, max_model_len=256, matmul_dtype=matmul_dtype)
        packed = [m.matmul_dtype for m in parts[0].modules() if isinstance(m, PackedLinear)]
        assert packed and set(packed) == {torch.bfloat16 if matmul_dtype == "bfloat16" else torch.float32}
        return llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].prompt_logprobs[1:]
    fp32, bf16, again = rows("auto"), rows("bfloat16"), rows("auto")
    top = [[next(t for t, lp in r.items() if lp.rank == 1) for r in rs] for rs in (fp32, bf16)]
    agree = sum(a == b for a, b in zip(*top)) / len(top[0])
    assert 0.9 <= agree, agree
    lp = [[r[t].logprob for r, t in zip(rs, ids[1:])] for rs in (fp32, bf16, again)]
    assert lp[0] != lp[1]                                            # the products did change: rounded, not skipped
    assert abs(sum(lp[1]) / sum(lp[0]) - 1) < 0.02                   # the text's log-likelihood within 2%
    assert lp[2] == lp[0]                                            # packed back for float32: exactly as before

def test_matmul_dtype_bad_input(monkeypatch):
    with pytest.raises(ValueError, match="matmul_dtype.*'auto', 'bfloat16'"): LLM(log=False, matmul_dtype="fp8")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)   # a CPU without bfloat16 products
    with pytest.raises(ValueError, match="matmul_dtype='bfloat16'.*AVX512-BF16.*use matmul_dtype='auto'"):
        LLM(log=False, num_gpu_blocks_override=16, max_model_len=128, matmul_dtype="bfloat16")
