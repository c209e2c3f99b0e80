"""vLLM's block hashes and KV-cache events (`09c_vllm_events`), checked against what a real vLLM published.

`tests/fixtures/vllm_kv_events.bin` was recorded from vLLM 0.32's CPU build serving the embedded SmolLM2-135M-Instruct
(the command and the prompts are in `vllm_kv_events.json`). The live test starts a vLLM of its own when
`PAGEDNB_VLLM_PYTHON` names a Python with vLLM installed (minutes on a CPU), and is skipped otherwise."""
import json, os, random, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path
import msgspec
import pytest
from pagednb.vllm_events import (BlockRemoved, BlockStored, EventDecoder, Frame, KVEventSubscriber, PrefixCacheMirror,
                                 block_hash_chain, cbor, decode_event, read_frames, vllm_block_hashes, write_frames)

FIXTURES = Path(__file__).resolve().parent/"fixtures"
META = json.loads((FIXTURES/"vllm_kv_events.json").read_text())
FRAMES = read_frames(FIXTURES/"vllm_kv_events.bin")

def _published():
    "Every BlockStored event of the recording, decoded."
    d = EventDecoder()
    return [e for f in FRAMES for e in d.decode(f) if isinstance(e, BlockStored)]

def test_our_hashes_are_the_ones_vllm_published():
    published = _published()
    chain = {h for e in published for h in e.block_hashes}
    ours = [vllm_block_hashes(ids, META["block_size"], META["hash_algo"], seed=META["pythonhashseed"])
            for ids in META["token_ids"]]
    assert {h for hs in ours for h in hs} == chain                     # every stored block, and nothing else
    first = published[0]
    assert first.parent_block_hash is None and first.block_hashes == ours[0]
    assert [e.parent_block_hash for e in published[1:]] == [ours[0][-1]] * (len(published) - 1)

def test_the_token_ids_are_the_model_tokenizers():
    "vLLM tokenized the prompts as the model's own tokenizer does, so a client can hash prompts it has not sent."
    transformers = pytest.importorskip("transformers")
    from pagednb.model import embedded_model_path
    tok = transformers.AutoTokenizer.from_pretrained(embedded_model_path())
    assert [tok(p)["input_ids"] for p in META["prompts"]] == META["token_ids"]

def test_mirror_of_the_recording_holds_every_full_prompt_block():
    m = PrefixCacheMirror(seed=META["pythonhashseed"])
    m.feed(FRAMES)
    assert (m.block_size, len(m.blocks), m.decoder.malformed, m.decoder.missed) == (128, 4, 0, 0)
    for ids in META["token_ids"]: assert m.cached_prefix(ids) == len(ids) // 128
    assert PrefixCacheMirror(block_size=128).cached_prefix(META["token_ids"][0]) == 0   # no events, no hits

def test_cbor_algorithm_chains_and_differs_from_pickle():
    ids = META["token_ids"][1]
    a, b = block_hash_chain(ids, 128, "sha256"), block_hash_chain(ids, 128, "sha256_cbor")
    assert len(a) == len(b) == 3 and all(x != y for x, y in zip(a, b)) and all(len(x) == 32 for x in a + b)
    assert cbor((b"\x00", (1, 2), None)) == bytes.fromhex("8341008201" + "02f6")

def test_decoder_never_raises_on_garbage():
    rng, d = random.Random(0), EventDecoder()
    junk = [bytes(rng.randrange(256) for _ in range(rng.randrange(40))) for _ in range(300)]
    shapes = [[], {}, [1.0], [1.0, "x"], [1.0, [None, 3, "BlockStored", ["BlockStored"], {"type": 5}]],
              [1.0, [{"type": "BlockStored", "block_hashes": "abc"}, ["BlockRemoved", [1.5], "GPU"]]]]
    frames = [Frame(b"t", i, p) for i, p in enumerate(junk + [msgspec.msgpack.encode(s) for s in shapes])]
    events = [e for f in frames for e in d.decode(f)]
    assert events == [] and d.malformed > 300 and len(d.errors) == 20

def test_both_wire_forms_decode_alike():
    tagged = {"type": "BlockRemoved", "block_hashes": [b"\x00" * 24 + b"\x00" * 7 + b"\x05"], "medium": "CPU"}
    assert decode_event(tagged) == decode_event(["BlockRemoved", [5], "CPU"]) == BlockRemoved([5], "CPU")

def test_recording_round_trip(tmp_path):
    write_frames(tmp_path/"r.bin", FRAMES)
    assert read_frames(tmp_path/"r.bin") == FRAMES
    assert (tmp_path/"r.bin").read_bytes() == (FIXTURES/"vllm_kv_events.bin").read_bytes()

VLLM_PYTHON = os.environ.get("PAGEDNB_VLLM_PYTHON")

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())

def _wait_up(proc, url, log, limit=1200):
    "Wait until vLLM answers on `url`; fail with the end of its log if it dies or takes too long."
    end = time.time() + limit
    while time.time() < end:
        if proc.poll() is not None: pytest.fail("vLLM exited:\n" + log.read_text()[-3000:])
        try: return json.loads(urllib.request.urlopen(url + "/v1/models", timeout=5).read())["data"][0]["id"]
        except OSError: time.sleep(3)
    pytest.fail("vLLM did not come up in time:\n" + log.read_text()[-3000:])

@pytest.mark.skipif(not VLLM_PYTHON, reason="set PAGEDNB_VLLM_PYTHON to a Python with vLLM installed to run it")
def test_live_vllm_publishes_the_hashes_we_compute(tmp_path):
    from pagednb.model import embedded_model_path
    port, endpoint = _free_port(), f"ipc://{tmp_path}/kv-events.ipc"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")                    # 1 GiB of KV cache when it runs on a CPU
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(embedded_model_path()),
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--kv-events-config", json.dumps(config)]
    log = tmp_path/"vllm.log"
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        model = _wait_up(proc, url, log)
        prompt = "The prefix cache keeps full blocks of tokens. " * 40
        with KVEventSubscriber(endpoint, topic="kv") as sub:
            time.sleep(1.0)
            ids = _post(url + "/tokenize", {"model": model, "prompt": prompt})["tokens"]
            _post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
            mirror = PrefixCacheMirror(seed="0")
            mirror.feed(list(sub.frames(duration=60, idle=5)))
        assert mirror.block_size and mirror.decoder.malformed == 0
        assert mirror.cached_prefix(ids) == len(ids) // mirror.block_size > 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
