"`pagednb serve` against a real server process on 127.0.0.1, driven by the real `openai` client."
import asyncio, json, os, re, socket, subprocess, sys, tempfile, time
import httpx, openai, pytest
from concurrent.futures import ThreadPoolExecutor
from openai.types.chat import ChatCompletionChunk

KEY, NAME, MAX_MODEL_LEN = "test-key", "smol-test", 512
SYSTEM = ("You are a patient teacher of computer systems. You explain memory, caches, paging and scheduling with small "
          "concrete examples, and you always check the learner's understanding before moving on.")
SPEC_PROMPT = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"                 # repetitive: n-gram drafts get accepted
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colours are"]
CHATS = [[{"role": "user", "content": "What is a cache?"}], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a page?"}]]

def _free_port():
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); return s.getsockname()[1]

class ServerProcess:
    "A `pagednb serve` process on a free loopback port with a small KV cache; `ready()` waits for /health and returns its URL."
    def __init__(self, *args, env=None):
        port, self.log = _free_port(), tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [sys.executable, "-m", "pagednb.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", NAME,
               "--kv-cache-memory-bytes", "256M", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "512",
               "--uvicorn-log-level", "warning", *args]
        self.p, self.url, self.t0 = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{port}", time.time()
    def ready(self, timeout=180):
        while True:
            if self.p.poll() is not None or time.time() - self.t0 > timeout:
                self.log.seek(0); pytest.fail(f"the server did not start (rc={self.p.poll()}):\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200: return self.url
            except httpx.HTTPError: pass
            time.sleep(0.3)
    def stop(self):
        self.p.terminate()
        try: self.p.wait(15)
        except subprocess.TimeoutExpired: self.p.kill(); self.p.wait(5)
        self.log.close(); os.unlink(self.log.name)

@pytest.fixture(scope="module")
def _server_process():
    p = ServerProcess("--api-key", "another-key", KEY); yield p; p.stop()      # any of several keys

@pytest.fixture(scope="module")
def server(_server_process, reference):
    "The URL of the main server (its boot overlaps the reference run)."
    return _server_process.ready()

@pytest.fixture(scope="module")
def client(server): return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)

LOAD_QUESTIONS = ["page", "cache", "block", "hash"]
def load_chat(i): return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: what is a {LOAD_QUESTIONS[i % 4]}?"}]

@pytest.fixture(scope="module")
def reference(_server_process):
    "Greedy outputs of the offline API (`LLM.generate` / `LLM.chat`) for every prompt the equivalence checks use, in one batch."
    import torch
    from pagednb.engine import LLM
    from pagednb.sampling import SamplingParams
    threads = torch.get_num_threads(); torch.set_num_threads(1)             # the CPU is shared with the server process
    try:
        llm = LLM(kv_cache_memory_bytes=64*2**20, max_model_len=MAX_MODEL_LEN, log=False)
        tok = llm.get_tokenizer()
        ids = tok("Once upon a time", add_special_tokens=False)["input_ids"]
        sp = SamplingParams(temperature=0, max_tokens=10)
        outs = llm.generate(PROMPTS + [ids, SPEC_PROMPT], sp, use_tqdm=False)
        chats = llm.chat(CHATS + [load_chat(i) for i in range(4)], sp, use_tqdm=False)
        return dict(ids=ids, completions=outs[:4], spec=outs[4], chats=chats[:2], load=chats[2:])
    finally: torch.set_num_threads(threads)

def metrics(url):
    "The samples of /metrics as {name{labels}: value}, labels without model_name."
    out = {}
    for line in httpx.get(url + "/metrics", timeout=120).text.splitlines():
        if line.startswith("#") or not line: continue
        k, v = line.rsplit(" ", 1)
        out[re.sub(r'(model_name|engine)="[^"]*",?', "", k).replace(",}", "}").replace("{}", "")] = float(v)
    return out

def wait_idle(url, timeout=90):
    "Poll /metrics until nothing runs or waits and no block is used; returns the last metrics."
    t0 = time.time()
    while True:
        m = metrics(url)
        if m['pagednb:kv_blocks{state="used"}'] == 0 and m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.time() - t0 < timeout, f"the server did not go idle: {m}"
        time.sleep(0.2)

def concurrently(*fns):
    "Run the thunks at once (so the server batches them); returns their results in order."
    with ThreadPoolExecutor(len(fns)) as ex: return [f.result() for f in [ex.submit(fn) for fn in fns]]

def test_health_and_models(server, client):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].max_model_len == MAX_MODEL_LEN

def test_completions_equal_offline(client, reference):
    ref, kw = reference["completions"], dict(model=NAME, max_tokens=10, temperature=0)
    stream = lambda p: lambda: list(client.completions.create(prompt=p, stream=True, stream_options={"include_usage": True}, **kw))
    batch, by_ids, *streams = concurrently(lambda: client.completions.create(prompt=PROMPTS, **kw),
                                           lambda: client.completions.create(prompt=reference["ids"], **kw), *map(stream, PROMPTS))
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [o.outputs[0].text for o in ref[:3]]
    assert [c.finish_reason for c in batch.choices] == [o.outputs[0].finish_reason for o in ref[:3]]
    assert batch.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in ref[:3])
    assert batch.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref[:3])
    assert by_ids.choices[0].text == ref[3].outputs[0].text                                   # token ids in
    for chunks, o in zip(streams, ref):                                                      # streaming: the same text
        assert "".join(c.choices[0].text for c in chunks if c.choices) == o.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [o.outputs[0].finish_reason]
        assert chunks[-1].usage.completion_tokens == len(o.outputs[0].token_ids) and chunks[-1].choices == []

def test_chat_equal_offline(client, reference):
    kw = dict(model=NAME, temperature=0)
    whole = [lambda m=m: client.chat.completions.create(messages=m, max_tokens=10, **kw) for m in CHATS]
    streamed = [lambda m=m: list(client.chat.completions.create(messages=m, max_completion_tokens=10, stream=True, **kw)) for m in CHATS]
    res = concurrently(*whole, *streamed)
    for r, chunks, o in zip(res[:2], res[2:], reference["chats"]):
        assert r.choices[0].message.content == o.outputs[0].text and r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == o.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(o.prompt_token_ids) and r.usage.completion_tokens == len(o.outputs[0].token_ids)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == o.outputs[0].text
        assert chunks[-1].choices[0].finish_reason == o.outputs[0].finish_reason

def test_sampling_n_logprobs_stop(client):
    P = "One, two, three, four,"
    kw = dict(model=NAME, prompt="My favourite animals are", max_tokens=8, temperature=0.9, seed=7)
    a, b, r, c = concurrently(lambda: client.completions.create(n=3, **kw), lambda: client.completions.create(n=3, **kw),
                              lambda: client.completions.create(model=NAME, prompt=P, max_tokens=10, temperature=0, logprobs=2),
                              lambda: client.chat.completions.create(model=NAME, messages=CHATS[0], max_tokens=4, temperature=0,
                                                                     logprobs=True, top_logprobs=2))
    assert [x.index for x in a.choices] == [0, 1, 2] and [x.text for x in a.choices] == [x.text for x in b.choices]   # seeded
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) >= 2 and v <= 0 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert len(c.choices[0].logprobs.content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in c.choices[0].logprobs.content)
    full = r.choices[0].text
    stop = full.strip().split()[1]                                     # a word that the greedy text contains
    cut, streamed = concurrently(lambda: client.completions.create(model=NAME, prompt=P, max_tokens=10, temperature=0, stop=[stop]),
                                 lambda: list(client.completions.create(model=NAME, prompt=P, max_tokens=10, temperature=0, stop=[stop], stream=True)))
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.index(stop)]
    assert "".join(x.choices[0].text for x in streamed) == cut.choices[0].text     # held back: no piece of the stop string leaks

async def _load(url, n, max_tokens):
    "n concurrent streaming chats sharing a system prompt; returns per request (chunks, raw data lines)."
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=240)
    async def one(i):
        msgs = load_chat(i)
        async with client.chat.completions.with_streaming_response.create(
                model=NAME, messages=msgs, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}) as resp:
            assert resp.http_response.status_code == 200
            lines = [l async for l in resp.iter_lines() if l]
        return i, lines
    try: return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(n)]), 600)
    finally: await client.close()

def test_load_128_streams(server, reference):
    n, max_tokens = 128, 10
    before = metrics(server)
    results = asyncio.run(_load(server, n, max_tokens))
    assert sorted(i for i, _ in results) == list(range(n))
    ids, texts = set(), {}
    for i, lines in results:
        assert all(l.startswith("data: ") for l in lines) and lines[-1] == "data: [DONE]"         # every stream ends
        chunks = [ChatCompletionChunk.model_validate(json.loads(l[6:])) for l in lines[:-1]]       # OpenAI's chunk schema
        assert len({c.id for c in chunks}) == 1; ids.add(chunks[0].id)
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1, finals                                                          # one ending per choice
        assert 1 <= chunks[-1].usage.completion_tokens <= max_tokens and chunks[-1].choices == []
        texts[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(ids) == n                                                                         # none duplicated
    assert [texts[i] for i in range(4)] == [o.outputs[0].text for o in reference["load"]]       # no cross-talk under load
    m = wait_idle(server)
    assert m['pagednb:kv_blocks{state="used"}'] == 0 and m["pagednb:kv_blocks_invariants_ok"] == 1
    assert m['pagednb:kv_blocks{state="cached"}'] > 0                                           # free, but still holding prefixes
    hits = m["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = m["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert queries > 0 and hits/queries > 0.3, (hits, queries)                                  # the shared system prompt is reused
    assert m["pagednb:prefix_cache_hit_rate"] > 0
    assert m["vllm:time_to_first_token_seconds_count"] >= n and m['vllm:time_to_first_token_seconds_bucket{le="+Inf"}'] >= n
    assert m["vllm:inter_token_latency_seconds_count"] > 0 and m["vllm:request_queue_time_seconds_count"] >= n
    assert m['vllm:request_success_total{finished_reason="length"}'] >= n

def test_disconnects_free_blocks(server):
    before = metrics(server).get('vllm:request_success_total{finished_reason="abort"}', 0)
    body = dict(model=NAME, prompt="Once upon a time, in a land far away,", max_tokens=300, ignore_eos=True, temperature=0, stream=True)
    hdr = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=120) as c:
        for _ in range(3):                                                    # streaming clients that hang up after two chunks
            with c.stream("POST", server + "/v1/completions", json=body, headers=hdr) as r:
                it = r.iter_lines(); got = [next(it), next(it)]
            assert got[0].startswith("data: ")
    with pytest.raises(httpx.ReadTimeout):                                    # a non-streaming client that gives up
        httpx.post(server + "/v1/completions", json={**body, "stream": False}, headers=hdr, timeout=3)
    wait_idle(server)
    t0 = time.time()
    while metrics(server).get('vllm:request_success_total{finished_reason="abort"}', 0) - before < 4:
        assert time.time() - t0 < 30, "the disconnected requests were not aborted"
        time.sleep(0.2)

BAD = [  # (what, request kwargs for httpx.post, expected status, expected param)
    ("malformed JSON", dict(content=b'{"prompt": "hi",'), 400, None),
    ("not an object", dict(json=[1, 2]), 400, None),
    ("wrong type", dict(json={"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
    ("wrong type, int", dict(json={"prompt": "hi", "n": 1.5}), 400, "n"),
    ("missing prompt", dict(json={"max_tokens": 5}), 400, "prompt"),
    ("max_tokens over the context", dict(json={"prompt": "hi", "max_tokens": 10_000}), 400, "max_tokens"),
    ("prompt too long", dict(json={"prompt": "hello " * 600, "max_tokens": 4}), 400, "prompt"),
    ("negative temperature", dict(json={"prompt": "hi", "temperature": -0.5}), 400, "temperature"),
    ("too large n", dict(json={"prompt": "hi", "n": 17}), 400, "n"),
    ("top_p out of range", dict(json={"prompt": "hi", "top_p": 0}), 400, "top_p"),
    ("token id out of vocabulary", dict(json={"prompt": [1, 2, 10**9]}), 400, "prompt"),
    ("unknown model", dict(json={"prompt": "hi", "model": "gpt-4"}), 404, "model"),
    ("body over 1 MiB", dict(json={"prompt": "a" * (1 << 20)}), 413, None),
    ("chunked body over 1 MiB", dict(content=(b"x" * 65536 for _ in range(20))), 413, None),
]

@pytest.mark.parametrize("what,kw,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests(server, what, kw, status, param):
    r = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=60, **kw)
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, err

def test_bad_requests_through_openai_and_still_serving(server, client):
    with pytest.raises(openai.BadRequestError) as e: client.chat.completions.create(model=NAME, messages=CHATS[0], temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e: client.chat.completions.create(model=NAME, messages=CHATS[0], n=100)
    assert "16" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHATS[0], max_tokens=MAX_MODEL_LEN)
    assert e.value.code == "context_length_exceeded"
    r = client.chat.completions.create(model=NAME, messages=CHATS[0], max_tokens=2, extra_body={"foo": 1})   # unknown: ignored
    assert r.usage.completion_tokens <= 2
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello " * 600}])
    r = client.chat.completions.create(model=NAME, messages=CHATS[0], max_tokens=3, temperature=0)      # the engine kept serving
    assert r.choices[0].message.content and r.usage.completion_tokens <= 3
    assert wait_idle(server)["pagednb:kv_blocks_invariants_ok"] == 1

def test_api_key(server):
    assert httpx.get(server + "/v1/models").status_code == 401
    r = httpx.get(server + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(server + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).completions.create(model=NAME, prompt="hi", max_tokens=1)
    assert httpx.get(server + "/health").status_code == 200 and httpx.get(server + "/metrics").status_code == 200

def test_speculative_server(reference):
    "With --speculative-config, greedy outputs are unchanged and /metrics reports the drafts' acceptance."
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    proc = ServerProcess("--speculative-config", spec, env={"VLLM_API_KEY": "from-env"})
    try:
        url = proc.ready()
        assert httpx.get(url + "/v1/models").status_code == 401                          # $VLLM_API_KEY is the key
        client = openai.OpenAI(base_url=url + "/v1", api_key="from-env", max_retries=0, timeout=120)
        kw = dict(model=NAME, prompt=SPEC_PROMPT, max_tokens=10, temperature=0)
        whole, chunks = concurrently(lambda: client.completions.create(**kw), lambda: list(client.completions.create(stream=True, **kw)))
        ref = reference["spec"].outputs[0]
        assert whole.choices[0].text == ref.text and "".join(c.choices[0].text for c in chunks) == ref.text
        m = wait_idle(url)
        assert m["vllm:spec_decode_num_draft_tokens_total"] > 0 and m["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert 0 < m["pagednb:spec_decode_acceptance_rate"] <= 1 and m['pagednb:kv_blocks{state="used"}'] == 0
    finally: proc.stop()

def test_serve_publishes_kv_events(tmp_path):
    """`--kv-events-config` as vLLM takes it: the server's KV-cache events, read by the subscriber, mirror its cache;
    `--prefix-caching-hash-algo sha256_cbor` names the blocks by vLLM's CBOR hashes."""
    from pagednb.vllm_events import KVEventSubscriber, PrefixCacheMirror
    endpoint = f"ipc://{tmp_path}/serve-kv-events.ipc"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    p = ServerProcess("--kv-events-config", json.dumps(cfg), "--prefix-caching-hash-algo", "sha256_cbor",
                      env={"PYTHONHASHSEED": "0"})
    try:
        url = p.ready()
        with KVEventSubscriber(endpoint, topic="kv") as sub:
            time.sleep(0.5)
            ids = httpx.post(url + "/tokenize", json={"model": NAME, "prompt": SYSTEM * 2}, timeout=60).json()["tokens"]
            body = {"model": NAME, "prompt": SYSTEM * 2, "max_tokens": 2, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            assert r.status_code == 200, r.text
            mirror = PrefixCacheMirror(hash_algo="sha256_cbor", seed="0")   # vLLM's seed rule: PYTHONHASHSEED
            mirror.feed(list(sub.frames(duration=30, idle=2)))
        assert (mirror.decoder.malformed, mirror.block_size) == (0, 16)
        assert mirror.cached_prefix(ids) == len(ids) // 16 > 0
        assert mirror.cached_prefix([1] + ids) == 0
    finally: p.stop()
