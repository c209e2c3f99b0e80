#!/usr/bin/env python3
"""Record a running vLLM's KV-cache events and `/metrics` while sending it prompts that share a prefix.

    python tools/record_vllm_events.py --url http://127.0.0.1:8731 --events ipc:///tmp/kv-events.ipc \\
        --topic kv-events --out tests/fixtures

Start vLLM first with `--kv-events-config` publishing on `--events` (the command that made the fixtures is in
`tests/fixtures/vllm_kv_events.json`). Writes `vllm_kv_events.bin` (the frames, see `pagednb.vllm_events.read_frames`),
`vllm_kv_events.json` (the prompts, vLLM's token ids for them, the outputs) and `vllm_metrics.json` (the scrapes, only
the `vllm:` families `pagednb.vllm_read.metrics_series` reads). Add the command that started vLLM to both JSON files.
"""
import argparse, json, re, threading, time, urllib.request
from pathlib import Path
from pagednb.vllm_events import KVEventSubscriber, PrefixCacheMirror, read_frames

SYSTEM = ("This is the help desk of the inference team, second shift. You are a careful assistant for engineers who run "
          "language models in production. They serve models with vLLM on GPUs of every size, from a single consumer "
          "card to racks of data-centre accelerators, and they ask about memory, latency, throughput and cost. Answer in "
          "one short sentence, plainly, without marketing words. When a question is about memory, think of the "
          "weights, the activations, the KV cache and the overheads of the runtime, and say which of them matters. "
          "When a question is about latency, separate the time to the first token from the time between tokens, and "
          "say which one the user is asking about. When a question is about throughput, remember that batching many "
          "requests together is what makes a GPU efficient, and that the KV cache limits how many requests fit in a "
          "batch. When a question is about cost, count the GPU hours and the tokens they produce. If you are not sure, "
          "say so, and say what you would measure to find out. Never invent numbers; if a number is needed, say how to "
          "get it from the logs or the metrics of the server. Keep units straight: GiB are not GB, and tokens per second "
          "for one user are not tokens per second for the whole server.\n\n")
LONG_Q = ("Question: We serve a chat model to a few hundred users whose conversations share one long system prompt, and "
          "we see that the first token of every answer takes longer than we expected even when the GPU is mostly idle; "
          "the logs show a prefix cache hit rate close to zero, and the users complain that the assistant feels slow at "
          "the start of each reply but fast afterwards. We run one replica per GPU behind a round-robin load balancer, "
          "with the default block size and prefix caching left on, and the system prompt is rendered by the chat "
          "template with the current date at its top. What should we look at first, and why?\nAnswer:")
LONG_Q2 = ("Question: Our team moved the same model from one large GPU to two smaller ones with tensor parallelism, and "
           "the start-up log now reports more than twice as many tokens of KV cache as before, although the two cards "
           "together have about the same memory as the old one; the users also see the time between tokens drop. Is "
           "this expected? The model has eight key-value heads and sixty-four attention heads, the cards are connected "
           "by a fast link, and we kept the same maximum model length and the same memory utilization as before. What "
           "exactly changed in how the memory is split between the weights and the cache?\nAnswer:")
PROMPTS = [SYSTEM + "Question: What does a KV cache store?\nAnswer:", SYSTEM + LONG_Q,
           SYSTEM + "Question: What does a KV cache store?\nAnswer:", SYSTEM + LONG_Q2, "The capital of France is"]
KEEP = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"}

def post(url, body):
    "POST JSON, return the JSON answer."
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())

def kept(text):
    "The lines of a scrape that belong to the families in KEEP, unedited."
    name = lambda l: l.split()[2] if l.startswith("#") else re.split(r"[{ ]", l)[0]
    return "\n".join(l for l in text.splitlines() if l.strip() and name(l) in KEEP) + "\n"

def scrape_loop(url, out, stop):
    "Scrape `/metrics` about once a second until `stop` is set."
    t0 = time.time()
    while not stop.is_set():
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        out.append({"t": round(time.time() - t0, 3), "text": kept(text)})
        stop.wait(1.0)

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--events", default="tcp://localhost:5557")
    p.add_argument("--topic", default="")
    p.add_argument("--out", default="tests/fixtures")
    a = p.parse_args()
    out = Path(a.out)
    model = json.loads(urllib.request.urlopen(a.url + "/v1/models").read())["data"][0]["id"]
    scrapes, stop, tokens, outputs = [], threading.Event(), [], []
    with KVEventSubscriber(a.events, topic=a.topic, record=out/"vllm_kv_events.bin") as sub:
        time.sleep(1.0)                              # let the subscription reach the publisher before anything is sent
        th = threading.Thread(target=scrape_loop, args=(a.url, scrapes, stop))
        th.start()
        for prompt in PROMPTS:
            tokens.append(post(a.url + "/tokenize", {"model": model, "prompt": prompt})["tokens"])
            r = post(a.url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            outputs.append(r["choices"][0]["text"])
            for _ in sub.frames(duration=1.5): pass
        for _ in sub.frames(duration=2.0): pass
        stop.set()
        th.join()
    (out/"vllm_kv_events.json").write_text(json.dumps(dict(prompts=PROMPTS, token_ids=tokens, outputs=outputs), indent=1))
    (out/"vllm_metrics.json").write_text(json.dumps(dict(scrapes=scrapes), indent=1))
    frames = read_frames(out/"vllm_kv_events.bin")
    mirror = PrefixCacheMirror()
    mirror.feed(frames)
    print(f"{len(frames)} frames, {len(mirror.blocks)} blocks of {mirror.block_size} tokens")

if __name__ == "__main__": main()
