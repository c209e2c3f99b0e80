__version__ = "0.0.1"

import os as _os

def _no_gpu(environ=_os.environ, exists=_os.path.exists):
    "True where no GPU is visible, judged cheaply (no torch): no GPU device node, or CUDA_VISIBLE_DEVICES hides all."
    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1", "none", "NoDevFiles"): return True
    return not any(exists(d) for d in ("/dev/nvidia0", "/dev/dxg", "/dev/kfd"))    # NVIDIA, WSL, ROCm

# With no GPU, Triton runs its kernels only in its interpreter, which must be chosen before anything (torch's own
# modules included) imports triton: here, the first thing any `import pagednb...` runs.
if _no_gpu(): _os.environ.setdefault("TRITON_INTERPRET", "1")

# The names users reach for, loaded on first use (importing torch and transformers takes seconds).
_LAZY = {"LLM": "engine", "LLMEngine": "engine", "SamplingParams": "sampling", "RequestOutput": "sampling",
         "CompletionOutput": "sampling", "load_model": "model", "EngineArgs": "engine_args",
         "explain_vllm_log": "vllm_read", "vllm_block_hashes": "vllm_events"}

def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

def __dir__(): return sorted(list(globals()) + list(_LAZY))
