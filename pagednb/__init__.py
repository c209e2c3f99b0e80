__version__ = "0.0.1"

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
