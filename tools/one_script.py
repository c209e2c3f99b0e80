"""One script written for vLLM, run unchanged on vLLM and on pagednb (only the import line swapped); compare the tokens.

    PAGEDNB_VLLM_PYTHON=/path/to/vllm-venv/bin/python python tools/one_script.py [--save result.json]

`SCRIPT` below is an ordinary vLLM program: `from vllm import LLM, SamplingParams`, vLLM's knobs (`dtype`,
`enforce_eager`, `tensor_parallel_size`, `max_model_len`, `enable_prefix_caching`, `seed`, `kv_cache_memory_bytes`)
and `SamplingParams` fields (`temperature=0`, `max_tokens`, `stop`, `logprobs`, `repetition_penalty=1.0`, ...). It
runs once in vLLM's venv and once here with `from pagednb import LLM, SamplingParams`, on the embedded
SmolLM2-135M-Instruct in float32, and the greedy token ids and finish reasons of the two runs are compared.
Exit status 0 when they agree, 1 when they differ, 2 when a run fails."""
import argparse, json, os, subprocess, sys, tempfile

SCRIPT = '''
import json, sys
from vllm import LLM, SamplingParams

def main(model):
    llm = LLM(model=model, dtype="float32", enforce_eager=True, tensor_parallel_size=1, max_model_len=1024,
              enable_prefix_caching=True, seed=0, kv_cache_memory_bytes=1 << 30)
    prompts = ["The capital of France is", "def fibonacci(n):", "A short list of prime numbers: 2, 3, 5,",
               "Once upon a time, in a small village by the sea,"]
    params = [SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.0, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=32, stop=["\\n\\n"], top_p=1.0, top_k=-1),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=4, stop_token_ids=[2]),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=0.0, frequency_penalty=0.0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    chat = llm.chat([[{"role": "user", "content": "What is a cache? Answer in one sentence."}]],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    return [dict(prompt=o.prompt, token_ids=list(o.outputs[0].token_ids), text=o.outputs[0].text,
                 finish_reason=o.outputs[0].finish_reason, num_logprobs=len(o.outputs[0].logprobs or []))
            for o in outs + chat]

if __name__ == "__main__":                     # vLLM starts its engine core in a spawned process
    print("ONE_SCRIPT_RESULT " + json.dumps(main(sys.argv[1])), flush=True)
'''

def variant(engine):
    "The script's source for `engine` (`vllm` or `pagednb`): the same text, with only the import line swapped."
    return SCRIPT if engine == "vllm" else SCRIPT.replace("from vllm import LLM, SamplingParams", "from pagednb import LLM, SamplingParams")

def run(engine, python, model, threads=2, timeout=1800):
    "Run the script with `python`; returns its result list, or raises RuntimeError with the end of its output."
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    if engine == "vllm": env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"script_{engine}.py")
        with open(path, "w") as f: f.write(variant(engine))
        p = subprocess.run([python, path, str(model)], env=env, cwd=d, capture_output=True, text=True, timeout=timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith("ONE_SCRIPT_RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"{engine} failed (exit {p.returncode}):\n" + "\n".join((p.stderr or p.stdout).strip().splitlines()[-20:]))
    return json.loads(lines[-1][len("ONE_SCRIPT_RESULT "):])

def compare(a, b):
    "Per output: same token ids, same finish reason, and the first index where the ids differ (None if none)."
    rows = []
    for x, y in zip(a, b):
        first = next((i for i, (s, t) in enumerate(zip(x["token_ids"], y["token_ids"])) if s != t), None)
        if first is None and len(x["token_ids"]) != len(y["token_ids"]): first = min(len(x["token_ids"]), len(y["token_ids"]))
        rows.append(dict(prompt=x["prompt"][-40:], same_tokens=x["token_ids"] == y["token_ids"],
                         same_finish=x["finish_reason"] == y["finish_reason"], first_difference=first,
                         tokens=(len(x["token_ids"]), len(y["token_ids"])), finish=(x["finish_reason"], y["finish_reason"]),
                         logprobs=(x["num_logprobs"], y["num_logprobs"])))
    return rows

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDNB_VLLM_PYTHON"), help="python of a venv with vllm-cpu (default: $PAGEDNB_VLLM_PYTHON)")
    p.add_argument("--threads", type=int, default=2, help="threads for each engine (default 2)")
    p.add_argument("--save", default=None, help="write the comparison as JSON to this path")
    a = p.parse_args(argv)
    if not a.vllm_python: p.error("no vLLM: pass --vllm-python PATH or set PAGEDNB_VLLM_PYTHON")
    from pagednb.model import embedded_model_path
    model = embedded_model_path()
    try: res = {e: run(e, py, model, a.threads) for e, py in [("vllm", a.vllm_python), ("pagednb", sys.executable)]}
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    rows = compare(res["vllm"], res["pagednb"])
    for r in rows: print(json.dumps(r))
    ok = all(r["same_tokens"] and r["same_finish"] for r in rows)
    print(f"{sum(r['same_tokens'] for r in rows)}/{len(rows)} outputs with the same token ids, "
          f"{sum(r['same_finish'] for r in rows)}/{len(rows)} with the same finish reason (vLLM, then pagednb)")
    if a.save:
        with open(a.save, "w") as f: json.dump(dict(rows=rows, outputs=res), f, indent=1)
    return 0 if ok else 1

if __name__ == "__main__": sys.exit(main())
