"""GuideLLM's own request bodies, replayed against an in-process `pagednb serve`: no errors, well-formed SSE with usage.

The bodies in `tests/fixtures/guidellm_*.json` were sent by GuideLLM 0.8.1 to a recording fake server
(`tools/record_guidellm.py`); this test needs no GuideLLM. GuideLLM takes the model name from `/v1/models`, so the
replay puts the served name in each body, as GuideLLM would."""
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import httpx, pytest

FIXTURES = Path(__file__).parent / "fixtures"
NAME = "smol-replay"

def load(kind): return json.loads((FIXTURES / f"guidellm_{kind}.json").read_text())

@pytest.fixture(scope="module")
def url():
    from pagednb.engine import LLMEngine
    from pagednb.serve import OpenAIServer, build_app, BackgroundServer
    engine = LLMEngine(kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_batched_tokens=512, log=False)
    with BackgroundServer(build_app(OpenAIServer(engine, [NAME]))) as s: yield s.url

def parse_sse(text):
    "The JSON events of a server-sent-event stream, checking its framing: `data: ` lines, blank separators, `[DONE]` last."
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events and events[-1] == "data: [DONE]", f"the stream does not end with data: [DONE]: {text[-300:]!r}"
    for e in events: assert e.startswith("data: ") and "\n" not in e, f"not one `data:` line: {e[:200]!r}"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]

def replay(url, rec):
    "Send one recorded request as GuideLLM did (its headers, its body with the served model name); returns (status, text)."
    body = dict(rec["body"], model=NAME)
    with httpx.Client(timeout=300) as c:
        r = c.request(rec["method"], url + rec["path"], headers=rec["headers"], content=json.dumps(body))
        return r.status_code, r.headers.get("content-type", ""), r.text

def test_fixtures_are_guidellms():
    for kind, path in [("chat", "/v1/chat/completions"), ("text", "/v1/completions")]:
        f = load(kind)
        assert f["guidellm_version"] == "0.8.1" and f["request_format"] == path and f["requests"]
        assert all(r["path"] == path and r["body"]["stream"] for r in f["requests"])

def test_preflight(url):
    "GuideLLM's checks before it sends work: /health and /v1/models."
    for kind in ("chat", "text"):
        for line in load(kind)["other_requests"]:
            method, path = line.split(" ", 1)
            r = httpx.request(method, url + path, timeout=30)
            assert r.status_code == 200, f"{line}: {r.status_code} {r.text[:300]}"
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == NAME

@pytest.mark.parametrize("kind", ["chat", "text"])
def test_replay(url, kind):
    recs = load(kind)["requests"]
    with ThreadPoolExecutor(2) as ex: results = list(ex.map(lambda r: replay(url, r), recs))   # GuideLLM ran 2 streams
    errors = [(s, t[:300]) for s, _, t in results if s != 200]
    assert not errors, f"{len(errors)} of {len(recs)} GuideLLM {kind} requests failed: {errors[:2]}"
    for rec, (_, ctype, text) in zip(recs, results):
        assert ctype.startswith("text/event-stream"), ctype
        chunks = parse_sse(text)
        body = rec["body"]
        want = body.get("max_completion_tokens") or body.get("max_tokens")
        content = [c for c in chunks if c["choices"]]
        pieces = [(c["choices"][0].get("delta") or {}).get("content") if kind == "chat" else c["choices"][0].get("text") for c in content]
        assert any(pieces), "no text streamed"
        assert content[-1]["choices"][0]["finish_reason"] == "length"            # ignore_eos: exactly max tokens
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == want, last
        assert last["usage"]["prompt_tokens"] > 0 and last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + want
        if body.get("stream_options", {}).get("continuous_usage_stats"):        # as in vLLM: usage on every chunk
            counts = [c.get("usage", {}).get("completion_tokens") for c in content]
            assert None not in counts, "continuous_usage_stats: a content chunk has no usage"
            assert counts == sorted(counts) and counts[-1] == want, counts
