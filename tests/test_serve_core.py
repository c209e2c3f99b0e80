"""`pagednb serve` with its engine core in a process of its own: a dead core is reported to every open stream and by
/health, a slow client holds up no other stream, and no process outlives the server.

A tiny random-weight Llama with SmolLM2's tokenizer keeps the steps cheap; the servers are real `pagednb serve`
processes (the default mode: an API server process and an engine core process)."""
import asyncio, contextlib, json, os, signal, socket, subprocess, sys, tempfile, time
import httpx, psutil, pytest
from pagednb.bench_serving import _free_port

GOOD = dict(prompt="The capital of France is", max_tokens=4, temperature=0, ignore_eos=True)

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    "A tiny random Llama with SmolLM2's tokenizer and chat template, saved as a Hugging Face folder."
    from helpers import tiny_chat_model
    return tiny_chat_model(tmp_path_factory.mktemp("tiny"))

class Server:
    "A `pagednb serve` process over the tiny model; `core()` is its engine core process (a psutil.Process)."
    def __init__(self, model_dir, *args):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "pagednb.cli", "serve", str(model_dir), "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "512", "--num-gpu-blocks-override", "512", "--uvicorn-log-level", "warning", *args]
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        t0 = time.time()
        while True:
            assert self.p.poll() is None and time.time() - t0 < 180, f"the server did not start:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200: break
            except httpx.HTTPError: pass
            time.sleep(0.3)
        self.family = psutil.Process(self.p.pid).children(recursive=True)     # the core, multiprocessing's helpers
    def core(self):
        "The engine core process: the spawned child that runs `spawn_main`."
        return next(c for c in self.family if any("spawn_main" in a for a in c.cmdline()))
    def output(self):
        self.log.seek(0)
        return self.log.read()[-3000:]
    def stop(self):
        if self.p.poll() is None: self.p.kill()
        for c in self.family:
            if c.is_running(): c.kill()
        self.log.close()

def left_behind(procs, timeout=20):
    "The processes of `procs` still alive after `timeout` seconds."
    gone, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

def test_core_is_a_process_of_its_own(model_dir):
    "The default `pagednb serve` runs two processes; --disable-frontend-multiprocessing runs one."
    two, one = Server(model_dir), None
    try:
        assert two.core().pid != two.p.pid
        r = httpx.post(two.url + "/v1/completions", json=GOOD, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 4
        one = Server(model_dir, "--disable-frontend-multiprocessing")
        assert not any("spawn_main" in " ".join(c.cmdline()) for c in one.family)
        assert httpx.post(one.url + "/v1/completions", json=GOOD, timeout=60).json()["choices"][0]["text"] == r["choices"][0]["text"]
    finally:
        two.stop()
        if one is not None: one.stop()

def test_killed_core_fails_every_open_stream(model_dir):
    """SIGKILL to the core mid-stream: every open stream ends with an error event and [DONE], /health says 503, the
    server exits with status 1 and leaves no process behind."""
    srv = Server(model_dir)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                started = asyncio.Event()
                async def stream(i):
                    body = dict(GOOD, prompt=f"Stream {i} says", max_tokens=400, stream=True)
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        lines = []
                        async for l in r.aiter_lines():
                            if l.startswith("data: "): lines.append(l)
                            if len(lines) == 2 and i == 3: started.set()
                        return lines
                tasks = [asyncio.create_task(stream(i)) for i in range(4)]
                await asyncio.wait_for(started.wait(), 60)
                await asyncio.sleep(0.2)                                 # every stream is under way ...
                srv.core().kill()                                        # ... when the core dies
                t0 = time.time()
                res = await asyncio.wait_for(asyncio.gather(*tasks), 30)
                return res, time.time() - t0, (await c.get("/health")).status_code
        streams, seconds, health = asyncio.run(run())
        assert seconds < 10, seconds
        for lines in streams:
            assert lines[-1] == "data: [DONE]", lines[-3:]
            err = json.loads(lines[-2][6:])["error"]
            assert err["type"] == "internal_server_error" and "engine core process" in err["message"], err
        assert health == 503
        assert srv.p.wait(60) == 1, srv.output()
        assert "pagednb serve: error: the engine failed" in srv.output()
        assert left_behind(srv.family) == []
    finally: srv.stop()

def _slow_client(url, body):
    "A client that sends a streaming request and then reads nothing, with a tiny receive window."
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s

def test_slow_client_does_not_stall_others(model_dir):
    "While one client reads nothing of a large stream, other streams run at their usual pace and /health answers."
    srv = Server(model_dir)
    try:
        async def streams(n):
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async def one(i):
                    body = dict(GOOD, prompt=f"Fast client {i} says", max_tokens=24, stream=True)
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        lines = [l async for l in r.aiter_lines() if l.startswith("data: ")]
                    return "".join(json.loads(l[6:])["choices"][0]["text"] for l in lines[:-1])
                t0 = time.time()
                texts = await asyncio.gather(*[one(i) for i in range(n)])
                return texts, time.time() - t0
        alone, t_alone = asyncio.run(streams(4))
        slow = _slow_client(srv.url, dict(GOOD, max_tokens=400, n=16, logprobs=5, temperature=1.0, stream=True))
        try:
            time.sleep(1.0)                                                     # the slow stream is running
            beside, t_beside = asyncio.run(streams(4))
            assert beside == alone                                              # greedy: the same text
            assert t_beside < max(20.0, 5*t_alone), (t_alone, t_beside)
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        finally: slow.close()
        t0 = time.time()
        while True:                                                             # its pages come back
            text = httpx.get(srv.url + "/metrics", timeout=30).text
            used = next(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith('pagednb:kv_blocks{') and 'state="used"' in l)
            if used == 0: break
            assert time.time() - t0 < 60, "the slow client's request was not aborted"
            time.sleep(0.3)
    finally: srv.stop()

@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_shutdown_leaves_no_process(model_dir, how):
    """SIGTERM or Ctrl-C: the server drains, stops its core and exits 0; SIGKILL: the core notices the closed pipe and
    exits too."""
    srv = Server(model_dir)
    try:
        core = srv.core()
        assert httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=60).status_code == 200
        srv.p.send_signal(getattr(signal, how))
        srv.p.wait(60)
        assert "Traceback" not in srv.output(), srv.output()
        assert left_behind(srv.family) == [], [p.cmdline() for p in srv.family if p.is_running()]
        assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
    finally: srv.stop()

def _choices(url, body):
    "`(text, finish_reason, stop_reason)` of each choice of a completion, asked for whole or streamed."
    if not body.get("stream"):
        return [(c["text"], c["finish_reason"], c["stop_reason"])
                for c in httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"]]
    got = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"): continue
            for c in json.loads(line[6:])["choices"]:
                text, fin, why = got.get(c["index"], ("", None, None))
                got[c["index"]] = (text + c["text"], c["finish_reason"] or fin, c.get("stop_reason") or why)
    return [got[i] for i in sorted(got)]

def _metric(url, name):
    "The samples of metric `name` on /metrics: `{labels text: value}`."
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return {l.split("{")[1].split("}")[0] if "{" in l else "": float(l.split()[-1])
            for l in lines if l.startswith(name + "{") or l.startswith(name + " ")}

def test_stop_strings_are_found_by_the_api_server(model_dir):
    """The core only generates tokens; the API server decodes them and finds the stop strings: the same texts, finish
    and stop reasons as a server whose engine decodes itself, whole or streamed, and the core finishes those outputs
    as stopped (not aborted), their pages freed."""
    two, one = Server(model_dir), Server(model_dir, "--disable-frontend-multiprocessing")
    try:
        base = dict(prompt="The capital of France is", max_tokens=24, temperature=1.0, seed=3, n=2, ignore_eos=True)
        text = _choices(two.url, base)[0][0]
        stop = text[8:11]
        assert len(text) > 12 and stop.strip()
        for extra in (dict(), dict(stream=True), dict(include_stop_str_in_output=True)):
            # room to run on past the stop, so the core is still generating when the API server finds it (24 tokens
            # of a tiny model are gone in a few ms; an output already finished by length is recounted as a stop)
            body = dict(base, stop=[stop], max_tokens=400, **extra)
            split = _choices(two.url, body)
            assert split == _choices(one.url, body)
            assert split[0][1:] == ("stop", stop) and stop not in split[0][0][:-len(stop)]
            assert split[0][0].endswith(stop) == bool(extra.get("include_stop_str_in_output"))
        def reasons():
            return {k.split('finished_reason="')[1].split('"')[0]: v
                    for k, v in _metric(two.url, "vllm:request_success_total").items()}
        deadline = time.time() + 15                    # the core reports finished requests after their last token
        while (finished := reasons()).get("stop", 0) < 3 and time.time() < deadline: time.sleep(0.2)
        assert finished.get("stop", 0) >= 3 and not finished.get("abort"), finished   # finished as stopped
        usage = _metric(two.url, "vllm:kv_cache_usage_perc")
        assert usage and all(v == 0.0 for v in usage.values()), usage                  # every page back
    finally:
        two.stop()
        one.stop()

def test_serve_hands_max_logprobs_to_the_engine(monkeypatch):
    "`serve(max_logprobs=...)` is the server's limit and the engine's too: the engine client is built with it."
    import pagednb.serve
    seen = {}
    class NoTokenizer:
        engine = type("Config", (), {"tokenizer": None})()
        def shutdown(self): seen["shutdown"] = True
    def client(model, disable_frontend_multiprocessing, **engine_kwargs):
        seen.update(engine_kwargs)
        return NoTokenizer()
    monkeypatch.setattr(pagednb.serve, "build_engine_client", client)
    with pytest.raises(ValueError, match="no tokenizer"): pagednb.serve.serve("tiny", max_logprobs=7, seed=3)
    assert seen == {"max_logprobs": 7, "seed": 3, "heartbeat_timeout": 10.0, "shutdown": True}

def test_engine_and_server_agree_on_max_logprobs(model_dir):
    "`--max-logprobs 30` above the engine's default of 20: the core takes 25 logprobs as the server does."
    srv = Server(model_dir, "--max-logprobs", "30")
    try:
        r = httpx.post(srv.url + "/v1/completions", json={**GOOD, "logprobs": 25}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 25
        r = httpx.post(srv.url + "/v1/completions", json={**GOOD, "logprobs": 31}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    finally: srv.stop()

BIG = "hello world, the quick brown fox. " * 28_000                   # 952 KB: a body just under the 1 MiB cap
STALL_BOUND = 2.0   # seconds: the longest a /health answer or a stream's next chunk may take while big bodies tokenise

def _timed_stream(url, gaps):
    "Stream a long completion, recording the gap before each chunk."
    body = dict(GOOD, max_tokens=300, stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        t = time.monotonic()
        for line in r.iter_lines():
            if line.startswith("data: "): gaps.append(time.monotonic() - t); t = time.monotonic()

def test_large_tokenize_does_not_stall(model_dir):
    "Eight parallel ~1 MB /tokenize requests run off the event loop: /health and a running stream keep being served."
    from concurrent.futures import ThreadPoolExecutor
    s = Server(model_dir)
    try:
        gaps, health = [], []
        with ThreadPoolExecutor(10) as ex:
            stream = ex.submit(_timed_stream, s.url, gaps)
            while not gaps: time.sleep(0.01)
            t0 = time.monotonic()
            big = [ex.submit(httpx.post, s.url + "/tokenize", json={"prompt": BIG}, timeout=120) for _ in range(8)]
            while not all(f.done() for f in big):
                t = time.monotonic()
                assert httpx.get(s.url + "/health", timeout=30).status_code == 200
                health.append(time.monotonic() - t)
                time.sleep(0.05)
            took = time.monotonic() - t0
            assert all(f.result().status_code == 200 and f.result().json()["count"] > 200_000 for f in big)
            stream.result()
        print(f"\n8 x 1 MB /tokenize in {took:.1f} s: /health worst {max(health):.2f} s over {len(health)} probes, "
              f"stream's worst gap {max(gaps[1:]):.2f} s over {len(gaps)} chunks")
        assert max(health) < STALL_BOUND and max(gaps[1:]) < STALL_BOUND, (max(health), max(gaps[1:]))
    finally: s.stop()

def _slow_body(port, deadline):
    "Send a request's headers, then its declared body a byte every 0.3 s: seconds until the server closes, or None."
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
        t0 = time.monotonic()
        c.settimeout(0.3)
        while time.monotonic() - t0 < deadline:
            try:
                c.sendall(b" ")
                if c.recv(4096) == b"": return time.monotonic() - t0
            except socket.timeout: pass
            except OSError: return time.monotonic() - t0
    return None

def test_slow_bodies_closed_and_connections_capped(model_dir):
    "--body-timeout closes bodies sent a byte at a time; --max-connections-per-client answers the next one 429."
    from concurrent.futures import ThreadPoolExecutor
    s = Server(model_dir, "--body-timeout", "2", "--max-connections-per-client", "6")
    try:
        held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(6)]
        time.sleep(0.3)
        r = httpx.get(s.url + "/health", timeout=10)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_connections", r.text
        for c in held: c.close()
        time.sleep(0.3)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        with ThreadPoolExecutor(4) as ex: closed = list(ex.map(lambda _: _slow_body(s.port, 10), range(4)))
        print(f"\nslow bodies closed after {closed} s (--body-timeout 2)")
        assert all(t is not None and t < 4 for t in closed), closed
        assert httpx.post(s.url + "/v1/completions", json=GOOD, timeout=60).status_code == 200
    finally: s.stop()

STREAM_TOKENS = 480          # the tiny model writes them in about a second on a fast machine: long enough to be cut

def _stream_tokens(url, started):
    "Stream a `STREAM_TOKENS`-token completion; the number of text chunks before [DONE] and the last finish_reason."
    chunks, finish = 0, None
    body = dict(GOOD, max_tokens=STREAM_TOKENS, stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            started.set()
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                chunks, finish = chunks + 1, c["finish_reason"] or finish
            if line == "data: [DONE]": return chunks, finish
    return chunks, "cut"

def _wait_for_draining(url, limit=10.0):
    "Poll /health every 5 ms until it stops answering 200 (the server is draining), at most `limit` seconds."
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if httpx.get(url + "/health", timeout=5).status_code != 200: return
        time.sleep(0.005)
    raise AssertionError(f"the server still answered /health with 200 {limit} s after the stop signal")

@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_graceful_shutdown_drains_streams(model_dir, how):
    "A stop signal during 4 streams: each finishes whole, a new request gets 503, the server exits 0, no process left."
    import threading
    from concurrent.futures import ThreadPoolExecutor
    s = Server(model_dir, "--shutdown-timeout", "60")
    try:
        with ThreadPoolExecutor(4) as ex:
            started = [threading.Event() for _ in range(4)]
            streams = [ex.submit(_stream_tokens, s.url, e) for e in started]
            for e in started: assert e.wait(60)
            s.p.send_signal(getattr(signal, how))
            _wait_for_draining(s.url)             # the signal is handled: the server refuses new work from here on
            late = httpx.post(s.url + "/v1/completions", json=GOOD, timeout=30)
            done = [f.result() for f in streams]
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        assert done == [(STREAM_TOKENS, "length")] * 4, done
        assert s.p.wait(60) == 0, s.output()
        assert left_behind(s.family) == [], [p.cmdline() for p in s.family if p.is_running()]
        print(f"\n{how}: 4 in-flight streams finished whole, a new request got 503, exit status 0")
    finally: s.stop()

def test_stopped_core_is_noticed_and_recovers(model_dir):
    """SIGSTOP on the engine core: within --heartbeat-timeout the waiting stream ends with a clear 503 error, /health
    says 503 and new requests are refused; after SIGCONT /health is 200 again and requests are served."""
    s = Server(model_dir, "--heartbeat-timeout", "2")
    try:
        core = s.core()
        body = dict(GOOD, max_tokens=400, stream=True)
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            core.suspend()
            t0 = time.monotonic()
            rest = [l for l in lines if l.startswith("data: ")]
            waited = time.monotonic() - t0
        err = json.loads(rest[-2][6:])["error"]
        assert rest[-1] == "data: [DONE]" and err["code"] == "engine_core_unresponsive", rest[-3:]
        assert waited < 6, waited
        assert httpx.get(s.url + "/health", timeout=10).status_code == 503
        late = httpx.post(s.url + "/v1/completions", json=GOOD, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_core_unresponsive", late.text
        core.resume()
        t1 = time.monotonic()
        while httpx.get(s.url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() - t1 < 10, "the core did not come back"
            time.sleep(0.2)
        back = time.monotonic() - t1
        assert httpx.post(s.url + "/v1/completions", json=GOOD, timeout=60).status_code == 200
        print(f"\nSIGSTOP: the stream failed after {waited:.1f} s (bound 2 s); SIGCONT: /health 200 again after {back:.1f} s")
    finally:
        with contextlib.suppress(Exception): s.core().resume()
        s.stop()
