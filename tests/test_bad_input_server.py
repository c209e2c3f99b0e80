"""One bad request harms no one else: a live in-process server (tiny random-weight Llama, SmolLM2's tokenizer) gets
every kind of bad input, each next to a good request that must still come back right, while /health stays 200.

Tally (printed by test_bad_inputs_one_by_one, run with -s to see it): every case is tried, every one must be a clear
4xx error in OpenAI's shape naming the field, and the goal for 500s is 0."""
import asyncio, json, os, socket, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
import httpx, pytest

KEY = "clé-secrète-🔑"                                   # a non-ASCII key: compared as UTF-8 bytes
AUTH = {"Authorization": f"Bearer {KEY}".encode("utf-8")}
GOOD = dict(prompt="The capital of France is", max_tokens=3, temperature=0, ignore_eos=True)

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    "A tiny random Llama with SmolLM2's tokenizer and chat template, saved as a Hugging Face folder."
    from helpers import tiny_chat_model
    return tiny_chat_model(tmp_path_factory.mktemp("tiny"))

@pytest.fixture(scope="module")
def parts(model_dir):
    from pagednb.model import load_model
    return load_model(model_dir, dtype="float32", device="cpu")

ENGINE_KW = {"max_model_len": 256, "num_gpu_blocks_override": 256, "max_num_batched_tokens": 256, "log": False}

def make_engine(parts, **kw):
    from pagednb.engine import LLMEngine
    return LLMEngine(parts, **{**ENGINE_KW, **kw})

@pytest.fixture(scope="module")
def reference(parts):
    "Greedy outputs of the offline engine, computed before the server runs."
    from pagednb.engine import LLM
    from pagednb.sampling import SamplingParams
    llm = LLM(parts, max_model_len=256, num_gpu_blocks_override=64, log=False)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [GOOD["prompt"]] + [f"Good request {i} says" for i in range(8)]
    return {p: o.outputs[0].text for p, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False))}

@pytest.fixture(scope="module", params=["core process", "engine thread"])
def server(request, parts, model_dir, reference):
    """The server every bad input is sent to: its engine in a core process of its own (as `pagednb serve` runs it),
    then in a thread of the server's process."""
    from pagednb.serve import OpenAIServer, BackgroundServer, build_app, AsyncMPClient
    core = AsyncMPClient(model_dir, dtype="float32", **ENGINE_KW) if request.param == "core process" else make_engine(parts)
    srv = OpenAIServer(core, "tiny", api_key=KEY)
    with BackgroundServer(build_app(srv), header_timeout=1.0) as bg: yield bg.url

def post(url, path, timeout=60, headers=None, **kw):
    return httpx.post(url + path, headers={**AUTH, **(headers or {})}, timeout=timeout, **kw)

def check_good(url, reference, prompt=GOOD["prompt"]):
    r = post(url, "/v1/completions", json={**GOOD, "prompt": prompt})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference[prompt]

def check_healthy(url, reference):
    assert httpx.get(url + "/health").status_code == 200
    check_good(url, reference)

def raw(s): return dict(content=s.encode("utf-8") if isinstance(s, str) else s, headers={"Content-Type": "application/json"})

OK_OR_400 = (200, 400)                                          # served as vLLM serves it, or refused naming the field
SURROGATE = '{"prompt": "a\\ud800b", "max_tokens": 2}'          # valid JSON, not valid Unicode
CASES = [  # (what, path, request kwargs, status, param)
    ("malformed JSON", "/v1/completions", raw('{"prompt": "hi",'), 400, None),
    ("not an object", "/v1/completions", dict(json=[1, 2]), 400, None),
    ("deeply nested JSON", "/v1/completions", raw("[" * 100_000 + "]" * 100_000), 400, None),
    ("wrong type", "/v1/completions", dict(json={"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
    ("float n", "/v1/completions", dict(json={"prompt": "hi", "n": 1.5}), 400, "n"),
    ("bool n", "/v1/completions", dict(json={"prompt": "hi", "n": True}), 400, "n"),
    ("bool top_k", "/v1/completions", dict(json={"prompt": "hi", "top_k": True}), 400, "top_k"),
    ("bool max_tokens", "/v1/completions", dict(json={"prompt": "hi", "max_tokens": True}), 400, "max_tokens"),
    ("huge top_k", "/v1/completions", dict(json={"prompt": "Hi", "max_tokens": 3, "temperature": 1, "top_k": 1180591620717411303424}), 400, "top_k"),
    ("top_k over the vocabulary", "/v1/completions", dict(json={"prompt": "Hi", "top_k": 10**6, "temperature": 1}), 400, "top_k"),
    ("seed 2**64-1 with n=2", "/v1/completions", dict(json={"prompt": "Hi", "seed": 2**64 - 1, "n": 2, "temperature": 1}), OK_OR_400, "seed"),
    ("logprobs 10**6", "/v1/completions", dict(json={"prompt": "Hi", "logprobs": 10**6}), 400, "logprobs"),
    ("temperature 1e-38", "/v1/completions", dict(json={"prompt": "Hi", "temperature": 1e-38}), OK_OR_400, "temperature"),  # vLLM: greedy
    ("NaN temperature", "/v1/completions", raw('{"prompt": "hi", "temperature": NaN}'), 400, "temperature"),
    ("Infinity top_p", "/v1/completions", raw('{"prompt": "hi", "top_p": Infinity}'), 400, "top_p"),
    ("lone surrogate in prompt", "/v1/completions", raw(SURROGATE), 400, "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions", raw('{"messages": [{"role": "user", "content": "x\\udc00"}]}'), 400,
     "messages.0.content"),
    ("lone surrogate in stop", "/v1/completions", raw('{"prompt": "hi", "stop": ["\\ud83d"]}'), 400, "stop.0"),
    ("lone surrogate in a key", "/v1/completions", raw('{"prompt": "hi", "\\ud800": 1}'), 400, "\\ud800"),
    ("negative max_tokens", "/v1/completions", dict(json={"prompt": "hi", "max_tokens": -1}), 400, "max_tokens"),
    ("max_tokens over the context", "/v1/completions", dict(json={"prompt": "hi", "max_tokens": 10_000}), 400, "max_tokens"),
    ("prompt too long", "/v1/completions", dict(json={"prompt": "hello " * 600, "max_tokens": 4}), 400, "prompt"),
    ("token id out of vocabulary", "/v1/completions", dict(json={"prompt": [1, 2, 10**9]}), 400, "prompt"),
    ("one bad prompt in a batch", "/v1/completions", dict(json={"prompt": [[1, 2], [3, 10**9]], "max_tokens": 2}), 400, "prompt"),
    ("empty prompt list", "/v1/completions", dict(json={"prompt": []}), 400, "prompt"),
    ("unknown model", "/v1/completions", dict(json={"prompt": "hi", "model": "gpt-4"}), 404, "model"),
    ("logit_bias key not a token id", "/v1/completions", dict(json={"prompt": "hi", "logit_bias": {"abc": 1}}), 400, "logit_bias"),
    ("stop_token_ids out of vocabulary", "/v1/completions", dict(json={"prompt": "hi", "stop_token_ids": [10**9]}), 400, "stop_token_ids"),
    ("truncate_prompt_tokens 0", "/v1/completions", dict(json={"prompt": "hi", "truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens"),
    ("min_tokens over max_tokens", "/v1/completions", dict(json={"prompt": "hi", "max_tokens": 2, "min_tokens": 5}), 400, "min_tokens"),
    ("repetition_penalty 0", "/v1/completions", dict(json={"prompt": "hi", "repetition_penalty": 0}), 400, "repetition_penalty"),
    ("stream_options without stream", "/v1/completions", dict(json={"prompt": "hi", "stream_options": {"include_usage": True}}), 400,
     "stream_options"),
    ("top_logprobs without logprobs", "/v1/chat/completions", dict(json={"messages": [{"role": "user", "content": "hi"}],
                                                                         "top_logprobs": 2}), 400, "top_logprobs"),
    ("continue_final_message with add_generation_prompt", "/v1/chat/completions",
     dict(json={"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}), 400, "continue_final_message"),
    ("unknown role", "/v1/chat/completions", dict(json={"messages": [{"role": "robot", "content": "hi"}]}), 400, "messages.0.role"),
    ("no messages", "/v1/chat/completions", dict(json={"messages": []}), 400, "messages"),
    ("body over 1 MiB", "/v1/completions", dict(json={"prompt": "a" * (1 << 20)}), 413, None),
    ("chunked body over 1 MiB", "/v1/completions", dict(content=[b"x" * 65536] * 20,
                                                          headers={"Content-Type": "application/json"}), 413, None),
    ("text/plain body", "/v1/completions", dict(content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"}), 415, None),
    ("form body", "/v1/completions", dict(content=b"prompt=hi", headers={"Content-Type": "application/x-www-form-urlencoded"}), 415, None),
    ("no content type", "/v1/completions", dict(content=b'{"prompt": "hi"}'), 415, None),
    ("DNS-rebinding Host", "/v1/completions", dict(json=GOOD, headers={"Host": "evil.example:8000"}), 400, None),
    ("wrong API key", "/v1/completions", dict(json=GOOD, headers={"Authorization": "Bearer nope"}), 401, None),
    ("API key, other encoding", "/v1/completions", dict(json=GOOD, headers={"Authorization": f"Bearer {KEY}".encode("latin-1", "replace")}),
     401, None),
    ("unknown route", "/v1/nothing", dict(json={}), 404, None),
    ("detokenize out of vocabulary", "/detokenize", dict(json={"tokens": [1, 10**9]}), 400, "tokens"),
    ("tokenize neither prompt nor messages", "/tokenize", dict(json={}), 400, "prompt"),
    ("prompt of no accepted type", "/v1/completions", dict(json={"prompt": 5}), 400, "prompt"),
    ("message content of no accepted type", "/v1/chat/completions", dict(json={"messages": [{"role": "user", "content": 5}]}), 400,
     "messages.0.content"),
    ("5,000-digit logit_bias key", "/v1/completions", dict(json={"prompt": "hi", "logit_bias": {"9" * 5000: 1}}), 400, "logit_bias"),
    ("deeply nested chat_template_kwargs", "/v1/chat/completions", raw('{"messages": [{"role": "user", "content": "hi"}], '
     '"chat_template_kwargs": {"x": ' + "[" * 200 + "]" * 200 + "}}"), 400, "chat_template_kwargs"),
]

def test_bad_inputs_one_by_one(server, reference):
    tally = dict(tried=0, clear=0, server_errors=0)
    with ThreadPoolExecutor(2) as ex:
        for what, path, kw, status, param in CASES:
            bad = ex.submit(post, server, path, **kw)
            good = ex.submit(check_good, server, reference)                 # a normal request at the same time
            r = bad.result()
            good.result()
            tally["tried"] += 1
            tally["server_errors"] += r.status_code >= 500
            assert r.status_code in (status if isinstance(status, tuple) else (status,)), (what, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith("application/json"), (what, r.headers["content-type"])
            if r.status_code == 200:
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), (what, r.text[:300])
                tally["clear"] += 1
                continue
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (what, err)
            assert err["param"] == param, (what, err)
            assert "Traceback" not in err["message"] and "sys.set_int_max_str_digits" not in err["message"], (what, err)
            tally["clear"] += 1
            assert httpx.get(server + "/health").status_code == 200, what
    print(f"\nbad inputs: {tally['tried']} cases tried, {tally['clear']} clear errors, {tally['server_errors']} 500s")
    assert tally == dict(tried=len(CASES), clear=len(CASES), server_errors=0)
    check_healthy(server, reference)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FN = {"type": "function", "function": {"name": "f", "parameters": {}}}
REFUSED = [  # (path, field, value): each asks for what pagednb does not do, and vLLM serves
    *[(path, f, v) for path in ("/v1/completions", "/v1/chat/completions") for f, v in (
        ("guided_json", {"type": "object"}), ("guided_regex", "[a-z]+"), ("guided_choice", ["yes", "no"]),
        ("guided_grammar", "root ::= 'a'"), ("structured_outputs", {"json": {}}), ("guided_decoding_backend", "xgrammar"),
        ("response_format", {"type": "json_object"}))],
    *[("/v1/chat/completions", f, v) for f, v in (
        ("tool_choice", "required"), ("tool_choice", {"type": "function", "function": {"name": "f"}}), ("functions", [FN["function"]]),
        ("function_call", "auto"), ("chat_template", "{{ messages }}"), ("mm_processor_kwargs", {"a": 1}), ("documents", [{"text": "x"}]),
        ("reasoning_effort", "high"), ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"}),
        ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}), ("response_format", {"type": "json_schema"}))],
]
HARMLESS = dict(store=True, metadata={"a": "b"}, service_tier="auto", user="u-1")

def _body(path, extra): return {**(CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 2}), **extra}

def test_refused_fields_are_400_naming_them(server):
    "No silently ignored field: each of these is a 400 whose param and message name it and say vLLM serves it."
    for path, field, value in REFUSED:
        r = post(server, path, json=_body(path, {field: value}))
        err = r.json().get("error", {})
        assert r.status_code == 400 and err.get("param") == field and field in err["message"], (path, field, r.text[:300])
        assert "vLLM serves it" in err["message"], err
    print(f"\nrefused fields: {len(REFUSED)} requests, each a 400 naming its field")

def test_harmless_fields_are_warned(server, caplog):
    "Fields that change nothing about the output (store, metadata, service_tier, user): 200, and one warning naming them."
    for path in ("/v1/completions", "/v1/chat/completions"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="pagednb.serve"):
            r = post(server, path, json=_body(path, {**HARMLESS, "web_search_options": None, "use_beam_search": False}))
        assert r.status_code == 200, r.text[:300]
        warned = [m for m in caplog.messages if "change nothing about the output" in m]
        assert len(warned) == 1 and all(k in warned[0] for k in HARMLESS), caplog.messages

def test_no_logprobs_limit(parts):
    "max_logprobs=-1 is vLLM's 'no limit': the server's own range check lets 25 alternatives through."
    from pagednb.serve import OpenAIServer, BackgroundServer, build_app
    srv = OpenAIServer(make_engine(parts, max_logprobs=-1), "tiny", max_logprobs=-1)
    with BackgroundServer(build_app(srv)) as bg:
        r = httpx.post(bg.url + "/v1/completions", json={**GOOD, "logprobs": 25}, timeout=60)
        c = httpx.post(bg.url + "/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 25}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 25, r.text[:300]
    assert c.status_code == 200 and len(c.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25, c.text[:300]

def test_wrong_method_and_not_found_are_openai_json(server):
    for r in (httpx.get(server + "/v1/completions", headers=AUTH), httpx.delete(server + "/health"), httpx.get(server + "/nope")):
        assert r.status_code in (404, 405) and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert httpx.get(server + "/v1/models").json()["error"]["code"] == "invalid_api_key"        # 401, same shape

def test_burst_of_bad_requests_while_good_ones_stream(server, reference):
    "32 bad requests at once while 8 good ones stream: the good ones finish with the right tokens, /health stays 200."
    bad = {"prompt": "Hi", "max_tokens": 3, "temperature": 1, "top_k": 1180591620717411303424}
    async def run():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=120) as c:
            async def stream(i):
                p = f"Good request {i} says"
                async with c.stream("POST", "/v1/completions", json={**GOOD, "prompt": p, "stream": True}) as r:
                    assert r.status_code == 200
                    lines = [l async for l in r.aiter_lines() if l.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                return p, "".join(json.loads(l[6:])["choices"][0]["text"] for l in lines[:-1])
            async def health():
                return [(await c.get("/health")).status_code for _ in range(5)]
            res = await asyncio.gather(*[stream(i) for i in range(8)], *[c.post("/v1/completions", json=bad) for _ in range(32)], health())
            return res[:8], res[8:40], res[40]
    good, bads, healths = asyncio.run(run())
    assert all(text == reference[p] for p, text in good), good
    assert [r.status_code for r in bads] == [400]*32 and all(r.json()["error"]["param"] == "top_k" for r in bads)
    assert healths == [200]*5
    check_healthy(server, reference)

def test_guidellm_bodies(server, reference):
    "GuideLLM's chat and text bodies: continuous usage stats, ignore_eos, and fields this server does not know."
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}], "stream": True,
            "stream_options": opts, "max_tokens": 4, "max_completion_tokens": 4, "ignore_eos": True, "some_future_field": {"x": 1}}
    text = {"model": "tiny", "prompt": "Hello there", "stream": True, "stream_options": opts, "max_tokens": 4, "ignore_eos": True,
            "guidellm_extra": True}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
        with httpx.stream("POST", server + path, json=body, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200, r.read()
            chunks = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith("data: ") and l != "data: [DONE]"]
        assert all("usage" in c and c["usage"]["prompt_tokens"] > 0 for c in chunks), path           # usage on every chunk
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    check_healthy(server, reference)

def test_vllm_extras_work(server, reference):
    "vLLM's sampling extras reach SamplingParams instead of being refused."
    body = dict(GOOD, min_tokens=1, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"11": 1.0},
                include_stop_str_in_output=True, add_special_tokens=True, truncate_prompt_tokens=4, spaces_between_special_tokens=True)
    r = post(server, "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "chat_template_kwargs": {"custom": 1},
            "add_special_tokens": False, "bad_words": ["zebra"]}
    assert post(server, "/v1/chat/completions", json=chat).status_code == 200
    check_healthy(server, reference)

def test_tokenize_detokenize_version_ping(server, parts):
    tok = parts[1]
    r = httpx.post(server + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok("Hello world")["input_ids"] and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert len(r["token_strs"]) == r["count"]
    m = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert m["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert httpx.post(server + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    assert "version" in httpx.get(server + "/version").json()
    assert httpx.get(server + "/ping").status_code == 200 and httpx.post(server + "/ping").status_code == 200

def test_docs_are_off(server):
    for p in ("/docs", "/redoc", "/openapi.json"): assert httpx.get(server + p, headers=AUTH).status_code == 404

def test_unfinished_headers_time_out(server):
    "A connection that sends half a request line is closed (header timeout 1 s here), not held forever."
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /hea")
        t0 = time.time()
        assert s.recv(1024) == b""                       # closed by the server
        assert time.time() - t0 < 5
    assert httpx.get(server + "/health").status_code == 200

def test_metrics_vllm_names_and_escaping(parts):
    "vLLM's names, types and labels; a served name with a quote, a backslash and a newline still gives valid text."
    from pagednb.serve import OpenAIServer, BackgroundServer, build_app
    name = 'we"ird\\name\nx'
    with BackgroundServer(build_app(OpenAIServer(make_engine(parts, num_gpu_blocks_override=32), [name]))) as bg:
        prompt = "The capital of France is Paris. " * 8                       # over two KV blocks: the second request hits
        assert httpx.post(bg.url + "/v1/completions", json={**GOOD, "prompt": prompt, "model": name}).status_code == 200
        again = httpx.post(bg.url + "/v1/completions", json={**GOOD, "prompt": prompt, "model": name}).json()
        text = httpx.get(bg.url + "/metrics").text
    prom = pytest.importorskip("prometheus_client.parser")
    fams = {f.name: f for f in prom.text_string_to_metric_families(text)}
    for n, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"), ("vllm:kv_cache_usage_perc", "gauge"),
                    ("vllm:prefix_cache_queries", "counter"), ("vllm:prefix_cache_hits", "counter"), ("vllm:num_preemptions", "counter"),
                    ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"), ("vllm:request_success", "counter"),
                    ("vllm:time_to_first_token_seconds", "histogram"), ("vllm:inter_token_latency_seconds", "histogram"),
                    ("vllm:e2e_request_latency_seconds", "histogram"), ("vllm:request_prompt_tokens", "histogram"),
                    ("vllm:request_generation_tokens", "histogram"), ("vllm:request_queue_time_seconds", "histogram")]:
        assert fams[n].type == kind, n
        assert all(s.labels["model_name"] == name and s.labels["engine"] == "0" for s in fams[n].samples), n
    def val(fam, sample, **labels):
        return next(s.value for s in fams[fam].samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))
    info = fams["vllm:cache_config_info"].samples[0]                         # vLLM's cache settings as labels, value 1
    assert (info.value, info.labels["cache_dtype"], info.labels["num_gpu_blocks"]) == (1, "auto", "32")
    n_prompt = again["usage"]["prompt_tokens"]
    assert val("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 2*n_prompt             # cache hits counted too
    assert val("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") > 0
    assert val("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert val("vllm:request_success", "vllm:request_success_total", finished_reason="error") == 0
    assert val("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_count") == 2

def test_model_without_tokenizer(tmp_path):
    "No tokenizer: `serve` refuses to start with a clear error; an OpenAIServer over it answers token ids, and 400 for text."
    from helpers import tiny_hf_model
    from pagednb.model import load_model
    from pagednb.serve import OpenAIServer, BackgroundServer, build_app, serve
    tiny_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match="no tokenizer"): serve(str(tmp_path), num_gpu_blocks_override=16, max_model_len=64, log=False)
    eng = make_engine(load_model(tmp_path, dtype="float32", device="cpu"), max_model_len=64, num_gpu_blocks_override=16)
    with BackgroundServer(build_app(OpenAIServer(eng))) as bg:
        r = httpx.post(bg.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = httpx.post(bg.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        r = httpx.post(bg.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.post(bg.url + "/v1/completions", json={"prompt": [1, 2], "logprobs": 1}).status_code == 400

def test_docs_behind_the_key_when_enabled(parts):
    from pagednb.serve import OpenAIServer, BackgroundServer, build_app
    with BackgroundServer(build_app(OpenAIServer(make_engine(parts, num_gpu_blocks_override=16), api_key=["a", "b"], enable_docs=True))) as bg:
        assert httpx.get(bg.url + "/docs").status_code == 401
        assert httpx.get(bg.url + "/openapi.json", headers={"Authorization": "Bearer b"}).status_code == 200   # any of the keys

DEAD_ENGINE = """
import sys
import pagednb.engine as E
step = E.LLMEngine.step
def failing_step(self):                       # test-only: a step fails once a request asks for it
    if any("BOOM" in (r.prompt or "") for r in self.requests.values()): raise RuntimeError("simulated engine failure")
    return step(self)
E.LLMEngine.step = failing_step               # at import: the engine core process (spawned) imports this file too
if __name__ == "__main__":
    from pagednb.cli import main
    main(sys.argv[1:])
"""

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

@pytest.mark.parametrize("mode", [[], ["--disable-frontend-multiprocessing"]], ids=["core process", "engine thread"])
def test_dead_engine_exits_nonzero(model_dir, tmp_path, mode):
    "step() raising: every waiting client gets an error at once, /health answers 503, and the process exits non-zero."
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = tmp_path / "dead_engine.py"
    script.write_text(DEAD_ENGINE)
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.Popen([sys.executable, str(script), "serve", str(model_dir), "--port", str(port), "--max-model-len", "256",
                              "--num-gpu-blocks-override", "64", "--uvicorn-log-level", "warning", "--dtype", "float32", *mode],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            t0 = time.time()
            while True:
                assert p.poll() is None and time.time() - t0 < 120, "the server did not start"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200: break
                except httpx.HTTPError: time.sleep(0.3)
            assert httpx.post(url + "/v1/completions", json=GOOD, timeout=60).status_code == 200
            t1 = time.time()
            with httpx.stream("POST", url + "/v1/completions", json=dict(GOOD, max_tokens=240, stream=True), timeout=60) as waiting:
                lines = waiting.iter_lines()
                assert next(lines).startswith("data: ")                               # a client mid-stream ...
                boom = httpx.post(url + "/v1/completions", json=dict(GOOD, prompt="BOOM"), timeout=60)   # ... when the engine dies
                rest = [l for l in lines if l.startswith("data: ")]
            assert time.time() - t1 < 30
            assert boom.status_code == 500 and boom.json()["error"]["type"] == "internal_server_error", boom.text
            assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["type"] == "internal_server_error", rest[-3:]
            assert httpx.get(url + "/health", timeout=5).status_code == 503
            rc = p.wait(60)
        finally:
            if p.poll() is None: p.kill()
        log.seek(0)
        out = log.read()
    assert rc == 1, out[-2000:]
    assert "pagednb serve: error: the engine failed" in out, out[-2000:]

def test_bad_model_path_is_one_line():
    p = subprocess.run([sys.executable, "-m", "pagednb.cli", "serve", "/etc"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "config.json" in p.stderr, p.stderr[-1000:]

def test_failing_request_is_confined(parts, reference):
    "A request the engine must fail (its forward raises) gets a 500 alone; the requests batched with it finish right."
    from pagednb.serve import OpenAIServer, BackgroundServer, build_app
    eng = make_engine(parts, num_gpu_blocks_override=64)
    execute = eng.runner.execute
    def poisoned(plan):                                  # this engine instance only: a forward with POISON in it raises
        if any("POISON" in (sc.seq.request.prompt or "") for sc in plan.scheduled): raise RuntimeError("simulated kernel fault")
        return execute(plan)
    eng.runner.execute = poisoned
    with BackgroundServer(build_app(OpenAIServer(eng))) as bg:
        async def run():
            async with httpx.AsyncClient(base_url=bg.url, timeout=120) as c:
                goods = [c.post("/v1/completions", json={**GOOD, "prompt": f"Good request {i} says"}) for i in range(4)]
                return await asyncio.gather(c.post("/v1/completions", json={**GOOD, "prompt": "POISON pill"}), *goods)
        bad, *goods = asyncio.run(run())
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "internal_server_error", bad.text
        assert [g.json()["choices"][0]["text"] for g in goods] == [reference[f"Good request {i} says"] for i in range(4)]
        assert httpx.get(bg.url + "/health").status_code == 200
        assert httpx.post(bg.url + "/v1/completions", json=GOOD).json()["choices"][0]["text"] == reference[GOOD["prompt"]]
        assert 'finished_reason="error"} 1' in httpx.get(bg.url + "/metrics").text
