"""Record the exact HTTP requests GuideLLM sends, with a fake OpenAI server on loopback, as test fixtures.

    HF_HUB_OFFLINE=1 python tools/record_guidellm.py --guidellm /path/to/guidellm-venv/bin/guidellm \
        --tokenizer /path/to/model-folder --out tests/fixtures

The fake server answers `/v1/models`, `/health`, `/v1/chat/completions` and `/v1/completions` (streamed as server-sent
events with usage, or as one JSON body) with a fixed text, and writes every request it received (method, path, the
headers that matter, the JSON body) to `guidellm_<format>.json`. GuideLLM runs a few requests of a tiny synthetic
profile against it, once for chat and once for text completions. Only the standard library is used, so the script
runs with any Python."""
import argparse, json, os, subprocess, sys, tempfile, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = ["hello", " world", ",", " this", " is", " a", " fake", " stream", "."]
KEEP_HEADERS = ("content-type", "accept", "authorization")

class Recorder(BaseHTTPRequestHandler):
    "A fake OpenAI server that records each request it gets in `server.log`."
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, code, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def _record(self, body):
        self.server.log.append(dict(method=self.command, path=self.path, body=body,
                                    headers={k.lower(): v for k, v in self.headers.items() if k.lower() in KEEP_HEADERS}))
    def do_GET(self):
        self._record(None)
        if self.path.rstrip("/").endswith("/models"):
            return self._send(200, dict(object="list", data=[dict(id=self.server.model, object="model", created=0, owned_by="fake")]))
        self._send(200, {} if self.path.startswith("/health") else dict(error="not found"))
    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(n) or b"null")
        self._record(body)
        chat = self.path.endswith("/chat/completions")
        if not chat and not self.path.endswith("/completions"): return self._send(404, dict(error="not found"))
        k = min(len(WORDS), (body or {}).get("max_tokens") or (body or {}).get("max_completion_tokens") or len(WORDS))
        usage = dict(prompt_tokens=8, completion_tokens=k, total_tokens=8 + k)
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice = dict(index=0, finish_reason="length", **({"message": dict(role="assistant", content="".join(WORDS[:k]))} if chat
                                                               else {"text": "".join(WORDS[:k])}))
            return self._send(200, dict(id="fake-1", object=obj, created=0, model=self.server.model, choices=[choice], usage=usage))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        obj += ".chunk" if chat else ""
        for i, w in enumerate(WORDS[:k]):
            part = {"delta": {"content": w} | ({"role": "assistant"} if i == 0 else {})} if chat else {"text": w}
            ch = dict(id="fake-1", object=obj, created=0, model=self.server.model,
                      choices=[dict(index=0, finish_reason="length" if i == k - 1 else None, **part)])
            self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
            self.wfile.flush()
        last = dict(id="fake-1", object=obj, created=0, model=self.server.model, choices=[], usage=usage)
        self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True

def start(model="fake-model"):
    "A recording server on a free loopback port, in a daemon thread; `.log` holds the requests."
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    srv.log, srv.model = [], model
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv

def guidellm_cmd(guidellm, url, request_format, tokenizer, out_json, prompt_tokens=32, output_tokens=6, requests=3, streams=2):
    "The `guidellm run` command line of a small concurrent synthetic profile against `url`."
    return [guidellm, "run", "--backend", f"kind=openai_http,target={url},request_format={request_format}",
            "--profile", f"kind=concurrent,streams={streams}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out_json}", "--disable-console-interactive"]

def _portable(cmd, tokenizer, tmp, srv):
    "The command line as a reader would type it: no machine paths, no random port."
    s = " ".join(["guidellm"] + cmd[1:]).replace(tokenizer, "MODEL_FOLDER").replace(os.path.join(tmp, ""), "")
    return s.replace(f"127.0.0.1:{srv.server_address[1]}", "127.0.0.1:8000")

def record(guidellm, tokenizer, out_dir, timeout=600):
    "Run GuideLLM against a fresh recorder for chat and for text completions; write one fixture per format."
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    version = subprocess.run([guidellm, "--version"], capture_output=True, text=True).stdout.strip().split()[-1]
    for name, fmt in [("chat", "/v1/chat/completions"), ("text", "/v1/completions")]:
        srv = start()
        with tempfile.TemporaryDirectory() as d:
            cmd = guidellm_cmd(guidellm, f"http://127.0.0.1:{srv.server_address[1]}", fmt, tokenizer, os.path.join(d, "r.json"))
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=d)
        srv.shutdown()
        if p.returncode: sys.exit(f"guidellm failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        posts = [r for r in srv.log if r["method"] == "POST"]
        if not posts: sys.exit(f"guidellm sent no {fmt} request; it sent {[r['path'] for r in srv.log]}")
        for r in posts:
            r["headers"].pop("authorization", None)
        fixture = dict(guidellm_version=version, request_format=fmt, command=_portable(cmd, tokenizer, d, srv),
                       other_requests=sorted({f"{r['method']} {r['path']}" for r in srv.log if r["method"] != "POST"}), requests=posts)
        path = os.path.join(out_dir, f"guidellm_{name}.json")
        with open(path, "w") as f: json.dump(fixture, f, indent=1)
        print(f"{path}: {len(posts)} {fmt} requests from guidellm {version}")

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guidellm", default=os.environ.get("PAGEDNB_GUIDELLM", "guidellm"), help="the guidellm executable")
    p.add_argument("--tokenizer", required=True, help="a local Hugging Face folder with the tokenizer")
    p.add_argument("--out", default="tests/fixtures", help="folder of the fixtures (default tests/fixtures)")
    a = p.parse_args(argv)
    record(a.guidellm, a.tokenizer, a.out)

if __name__ == "__main__": main()
