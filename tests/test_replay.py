"""The trace replayer (`pagednb.replay`) against a stub server on loopback that records every request's arrival time.

Timestamps honoured within a tolerance, prompts sharing exactly the prefixes the workload says, runs bounded in
count and in time; goodput's search on synthetic latencies with a known answer; bad input named in its error."""
import contextlib, io, json, math, os, socket, time
import pytest
from pagednb import sim
from pagednb.sim import SimRequest, Workload
from pagednb.replay import (SALT, Replay, RequestResult, StubServer, Target, check_url, replay, search_rate,
                            summarize, sweep_replay)

TOL = 0.15          # seconds: the arrival of a request against its due time, on a loaded 2-core machine

def common(a, b):
    "The length of the common prefix of two token lists."
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

def test_timestamps_honoured():
    times = [0.0, 0.2, 0.5, 0.5, 0.9, 1.3]
    w = Workload([SimRequest(8, 2, t) for t in times])
    with StubServer() as stub:
        rep = replay(w, stub.url, time_scale=0.5)
        got = sorted(t for t, _ in stub.received)
    arrived = [t - got[0] for t in got]
    for due, t in zip([x * 0.5 for x in times], arrived): assert abs(t - due) < TOL, (due, t)
    for r in rep.requests: assert abs(r.sent - r.due) < TOL, (r.due, r.sent)
    assert all(r.ok for r in rep.requests) and math.isclose(rep.rate, 5 / 0.65)

def test_prefixes_shared_exactly():
    "Token-id prompts keep their shared prefix to the token; `sim` prompts of one prefix id share `prefix_len`."
    base = list(range(200, 300))
    a, b, c = base[:40] + [5, 6, 7], base[:40] + [8, 9], base[:70] + [1]
    w = Workload([SimRequest(a, 3, 0.0), SimRequest(b, 4, 0.01), SimRequest(c, 2, 0.02)])
    with StubServer() as stub:
        replay(w, stub.url, salt=SALT + 3)
        bodies = {len(body["prompt"]): body for _, body in stub.received}
    pa, pb, pc = (bodies[len(p) + 1]["prompt"] for p in (a, b, c))
    assert pa[0] == pb[0] == pc[0] == SALT + 3 and pa[1:] == a and pb[1:] == b and pc[1:] == c
    assert common(pa, pb) == 41 and common(pa, pc) == 41 and common(pb, pc) == 41
    assert {bodies[len(p) + 1]["max_tokens"] for p in (a, b, c)} == {3, 4, 2}
    body = bodies[len(a) + 1]
    assert body["ignore_eos"] and body["stream"] and body["stream_options"] == {"include_usage": True}
    shared = sim.shared_prompt(6, system_len=48, user_len=(8, 16), output_len=2, hit_ratio=0.5, rate=50.0, seed=1)
    with StubServer() as stub:
        replay(shared, stub.url)
        prompts = [body["prompt"] for _, body in stub.received]
    expected = [sim.prompt_tokens(q, i) for i, q in enumerate(shared.requests)]
    assert sorted(map(tuple, prompts)) == sorted(map(tuple, expected))
    pre = [e for e, q in zip(expected, shared.requests) if q.prefix_id == 0]
    assert len(pre) >= 2 and all(e[:48] == pre[0][:48] for e in pre)

def test_cached_tokens_and_hit_rate():
    w = Workload([SimRequest(list(range(100, 164)) + [i], 2, 0.05 * i) for i in range(4)])
    with StubServer(block_size=16) as stub: rep = replay(w, stub.url)
    assert [r.cached_tokens for r in rep.requests] == [0, 64, 64, 64]
    assert summarize(rep)["prefix_hit_rate"] == round(3 * 64 / (4 * 65), 4)

def test_bounded_in_count():
    w = Workload([SimRequest(8, 2, 0.01 * i) for i in range(10)])
    with StubServer() as stub:
        rep = replay(w, stub.url, max_requests=3)
        assert len(stub.received) == 3 and len(rep.requests) == 3

def test_bounded_in_time():
    "Requests not yet due at the deadline are not sent; streams still open are cut off and counted."
    w = Workload([SimRequest(8, 2, 0.0), SimRequest(8, 2, 0.05), SimRequest(8, 2, 30.0), SimRequest(8, 2, 60.0)])
    with StubServer() as stub:
        t0 = time.perf_counter()
        s = summarize(replay(w, stub.url, deadline=1.0))
        assert time.perf_counter() - t0 < 5 and len(stub.received) == 2
    assert (s["completed"], s["not_sent"], s["attainment"]) == (2, 2, 1.0)
    with StubServer(itl=0.5) as stub: s = summarize(replay(Workload([SimRequest(8, 20)]), stub.url, deadline=0.5))
    assert (s["completed"], s["incomplete"], s["attainment"]) == (0, 1, 0.0)

def synthetic(rate):
    "A run at `rate` whose request i of 10 has TTFT i * rate / 10 s: 9 of 10 meet TTFT <= 1 s up to rate 10/9."
    rs = [RequestResult(i, 0.0, sent=0.0, times=[i * rate / 10, i * rate / 10 + 0.01], latency=1.0)
          for i in range(1, 11)]
    return Replay(rs, 1.0, rate, 10.0, "http://127.0.0.1:1", "m")

def test_goodput_search_known_answer():
    t = Target(ttft=1.0, itl=0.05)
    assert summarize(synthetic(1.0), t)["attainment"] == 1.0 and summarize(synthetic(2.0), t)["attainment"] == 0.5
    g = search_rate(lambda r: summarize(synthetic(r), t), [0.25, 0.5, 1, 2, 4], t.attainment, bisect=14)
    assert math.isclose(g["goodput_rps"], 10 / 9, rel_tol=1e-3), g["goodput_rps"]
    assert g["bracket"][0] <= 10 / 9 < g["bracket"][1]
    assert search_rate(lambda r: summarize(synthetic(r), t), [2, 4])["goodput_rps"] == 0.0
    assert search_rate(lambda r: summarize(synthetic(r), Target(ttft=100)), [2, 4])["bracket"] == [4, None]

def test_sweep_against_a_server_that_slows():
    w = Workload([SimRequest(16, 3, 0.1 * i) for i in range(8)])
    with StubServer(ttft=lambda busy: 0.2 * busy, itl=0.002) as stub:          # alone: 0.2 s, 0.1 s inside the target
        g = sweep_replay(w, stub.url, Target(ttft=0.3, itl=0.05), rates=[2, 200], bisect=0)
    assert [p["attainment"] for p in g["points"]][0] == 1.0 and g["points"][-1]["attainment"] < 0.9
    assert g["goodput_rps"] == 2

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def test_unreachable_url_names_the_address():
    port = _free_port()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        replay(Workload([SimRequest(8, 2)]), f"http://127.0.0.1:{port}/v1")

@pytest.mark.parametrize("kw,match", [(dict(time_scale=-1.0), "time_scale=-1.0"), (dict(time_scale=0), "time_scale=0"),
                                      (dict(max_requests=0), "max_requests=0"), (dict(deadline=-5), "deadline=-5")])
def test_bad_knobs(kw, match):
    with pytest.raises(ValueError, match=match): replay(Workload([SimRequest(8, 2)]), "http://127.0.0.1:1", **kw)

def test_bad_workload_and_url():
    with pytest.raises(ValueError, match=r"request 1: arrival_time=-2.0"):
        replay(Workload([SimRequest(8, 2), SimRequest(8, 2, -2.0)]), "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="loopback"): check_url("http://192.168.1.10:8000")
    with pytest.raises(ValueError, match="loopback"): replay(Workload([SimRequest(8, 2)]), "http://example.com:80")
    with pytest.raises(ValueError, match="itl=0"): Target(itl=0)

def test_server_errors_are_counted():
    "A 404 (a server without /v1/completions) is an errored request with its status, not a crash."
    class NoCompletions(StubServer):
        async def _complete(self, body, writer):
            writer.write(b"HTTP/1.1 404 -\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno")
    with NoCompletions() as stub: s = summarize(replay(Workload([SimRequest(8, 2)]), stub.url))
    assert (s["errored"], s["completed"]) == (1, 0) and s["first_error"].startswith("HTTP 404")

def test_bench_cli_json_lines():
    "`pagednb bench --only replay --url ... --json` prints one JSON line per run with the figures."
    from pagednb.bench_cli import main
    out = io.StringIO()
    with StubServer() as stub, contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["--only", "replay", "--url", stub.url, "--json", "--max-requests", "6", "--time-scale", "0.02"])
    lines = [json.loads(l) for l in out.getvalue().splitlines()]
    keys = ("goodput_rps", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "completed", "errored", "prefix_hit_rate")
    assert len(lines) == 1 and all(k in lines[0] for k in keys) and lines[0]["completed"] == 6

@pytest.mark.parametrize("argv,match", [(["--time-scale", "-1"], "--time-scale"), (["--ttft", "0"], "--ttft"),
                                        (["--trace", "/nonexistent.jsonl"], "no such file"),
                                        (["--url", "http://10.0.0.1:80"], "loopback"),
                                        (["--vllm-flags", "256"], "--vllm-flags '256' is invalid")])
def test_bench_cli_bad_options(argv, match, capsys):
    from pagednb.bench_cli import main
    with pytest.raises(SystemExit): main(["--only", "replay", *argv])
    assert match in capsys.readouterr().err

@pytest.mark.skipif(not hasattr(sim, "load_trace"), reason="sim.load_trace (the trace reader) is not in this tree")
def test_trace_prefixes_reach_the_server(tmp_path):
    "A Mooncake-format trace: requests whose hash ids begin alike send prompts sharing those blocks' tokens."
    rows = [dict(timestamp=0, input_length=40, output_length=2, hash_ids=[1, 2, 3]),
            dict(timestamp=100, input_length=40, output_length=2, hash_ids=[1, 2, 4]),
            dict(timestamp=200, input_length=30, output_length=3, hash_ids=[5, 6])]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = sim.load_trace(str(path), block_size=16)
    with StubServer() as stub:
        replay(w, stub.url)
        p = [body["prompt"] for _, body in sorted(stub.received, key=lambda x: x[0])]
    assert common(p[0], p[1]) >= 32 and common(p[0], p[2]) < 16

def test_side_by_side_gives_both_servers_the_same_rates_and_length(monkeypatch):
    "The servers get the same rates, context length and workload, swept together; engine knobs reach pagednb only."
    from pagednb import replay as R
    calls = []
    def fake(specs, w, t, rates, **kw):
        calls.append((specs, w, rates, kw))
        return {n: dict(engine=s["engine"], goodput_rps=1.0, bracket=[1, 2], points=[]) for n, s in specs.items()}
    monkeypatch.setattr(R, "serve_together", fake)
    w = Workload([SimRequest(8, 2, 0.5 * i) for i in range(4)] + [SimRequest(5000, 2, 2.0)])
    out = R.side_by_side(w, Target(), vllm_python=R.__file__, knobs=dict(max_model_len=1024, block_size=32), bisect=1)
    [(specs, w1, r1, kw1)] = calls                                           # one lockstep sweep of both
    assert len(r1) == 5 and len(w1) == 4 and kw1 == dict(bisect=1)
    assert [s["engine"] for s in specs.values()] == ["pagednb", "vllm"]
    assert specs["pagednb serve"]["max_model_len"] == specs["vllm serve"]["max_model_len"] == 1024
    assert specs["pagednb serve"]["knobs"]["block_size"] == 32 and "knobs" not in specs["vllm serve"]
    assert set(out["servers"]) == {"pagednb serve", "vllm serve"}
    calls.clear()
    out = R.side_by_side(w, Target(), vllm_python=R.__file__, vllm_flags=(("--max-num-batched-tokens", "256"),),
                         one_at_a_time=True)
    assert [list(c[0]) for c in calls] == [["pagednb serve"], ["vllm serve"], ["vllm serve (--max-num-batched-tokens 256)"]]
    assert "flags" not in calls[1][0]["vllm serve"] and all(c[2] == r1 for c in calls)
    assert calls[2][0]["vllm serve (--max-num-batched-tokens 256)"]["flags"] == ("--max-num-batched-tokens", "256")
    assert list(out["servers"]) == ["pagednb serve", "vllm serve", "vllm serve (--max-num-batched-tokens 256)"]
    monkeypatch.setattr(R, "find_vllm_python", lambda p: None)
    calls.clear()
    out = R.side_by_side(w, Target())
    assert "skipped" in out["servers"]["vllm serve"] and list(calls[0][0]) == ["pagednb serve"]

def test_serve_together_sweeps_in_lockstep_and_reports_a_server_that_did_not_start(monkeypatch):
    "Servers that start are swept rate by rate in turn; one whose start fails is a `skipped` record, in its place."
    from pagednb import replay as R
    class Fake:
        def __init__(self, engine, fail=False, ttft=0.01, **kw): self.engine, self.fail, self.ttft = engine, fail, ttft
        def __enter__(self):
            if self.fail: raise RuntimeError("the server exited before it was ready")
            self.stub = StubServer(ttft=self.ttft, itl=0.005).__enter__()
            self.url, self.start_s = self.stub.url, 0.1
            return self
        def __exit__(self, *exc): self.stub.__exit__(*exc)
    monkeypatch.setattr(R, "replay_server", Fake)
    w = Workload([SimRequest(8, 2, 0.1 * i) for i in range(6)])
    runs = []
    specs = {"a": dict(engine="pagednb"), "b": dict(engine="vllm", fail=True), "c": dict(engine="vllm", ttft=0.2)}
    out = R.serve_together(specs, w, Target(ttft=0.1, itl=0.05), [5, 20], bisect=0, on_run=runs.append)
    assert list(out) == ["a", "b", "c"] and "skipped" in out["b"] and "exited" in out["b"]["skipped"]
    assert [r["server"] for r in runs] == ["a", "c", "a", "c"]
    assert out["a"]["goodput_rps"] == 20 and out["c"]["goodput_rps"] == 0.0 and out["c"]["engine"] == "vllm"

def test_a_stream_cut_short_is_an_error():
    "A stream that ends without `data: [DONE]` (a server that died mid-answer) is errored, not completed."
    class Dies(StubServer):
        async def _complete(self, body, writer):
            writer.write(b"HTTP/1.1 200 -\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
    with Dies() as stub: s = summarize(replay(Workload([SimRequest(8, 4)]), stub.url))
    assert (s["errored"], s["completed"]) == (1, 0) and "[DONE]" in s["first_error"]

def test_load_workload_reads_the_shipped_trace():
    "No `--trace`: the built-in chats; `mooncake`: the shipped trace through `sim.load_trace`."
    from pagednb.replay import load_workload
    assert len(load_workload(None)) == 32
    w = load_workload("mooncake", max_requests=5, length_scale=1/32)
    assert len(w) == 5 and all(isinstance(r.prompt, list) for r in w.requests)
