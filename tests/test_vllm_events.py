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


# --- pagednb publishes the same events: read back by the subscriber and the mirror above

from pagednb.vllm_events import (AllBlocksCleared, DEFAULT_SEED, ZmqEventPublisher, encode_batch, kv_events_config,
                                 make_event_publisher)

def _pagednb_cached(bm, ids):
    "How many leading full blocks of `ids` pagednb's own prefix cache holds."
    from pagednb.prefix_cache import compute_block_hashes
    from pagednb.block_manager import Sequence
    hs = compute_block_hashes(Sequence(-1, ids), bm.block_size, len(ids) // bm.block_size)
    return next((i for i, h in enumerate(hs) if h not in bm.hash_to_block), len(hs))

def test_pagednb_engine_publishes_what_its_prefix_cache_holds(tmp_path):
    from pagednb.engine import LLM
    from pagednb.sampling import SamplingParams
    endpoint = f"ipc://{tmp_path}/pagednb-kv.ipc"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    llm = LLM(num_gpu_blocks_override=40, max_model_len=512, log=False, kv_events_config=cfg)   # 640 tokens: evictions
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(100)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(rng.randrange(20, 200))] for _ in range(8)]
    bm = llm.engine.block_manager
    with KVEventSubscriber(endpoint, topic="kv") as sub:
        time.sleep(0.3)
        for i in range(0, 8, 2): llm.generate(prompts[i:i + 2], SamplingParams(max_tokens=3), use_tqdm=False)
        mirror = PrefixCacheMirror(seed=os.environ.get("PYTHONHASHSEED", DEFAULT_SEED))
        mirror.feed(list(sub.frames(idle=1.0)))
        d = mirror.decoder
        assert (d.malformed, d.missed, mirror.block_size) == (0, 0, 16) and mirror.removed > 0   # the pool overflowed
        assert set(mirror.blocks) == set(bm._event_hash.values()) and len(mirror.blocks) == len(bm.hash_to_block)
        for ids in prompts + [system + [7] * 40, [7] + system]:
            assert mirror.cached_prefix(ids) == _pagednb_cached(bm, ids)
        assert any(mirror.cached_prefix(p) > 0 for p in prompts)
        first = next(iter(mirror.blocks.values()))
        assert first.media == {"GPU"} and len(first.token_ids) == 16
        assert llm.reset_prefix_cache()
        mirror.feed(list(sub.frames(idle=1.0)))
    assert (mirror.blocks, mirror.cleared) == ({}, 1)
    llm.shutdown()

def test_prefix_caching_hash_algo_names_blocks_as_vllm_does(tmp_path):
    "`prefix_caching_hash_algo='sha256_cbor'`: the events carry vLLM's CBOR hashes; the xxhash ones are refused."
    from pagednb.engine import LLM
    from pagednb.engine_args import EngineArgs
    from pagednb.cli import make_parser
    from pagednb.sampling import SamplingParams
    endpoint = f"ipc://{tmp_path}/pagednb-cbor.ipc"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    llm = LLM(max_model_len=256, log=False, kv_events_config=cfg, prefix_caching_hash_algo="sha256_cbor")
    ids = list(range(1000, 1040))
    with KVEventSubscriber(endpoint, topic="kv") as sub:
        time.sleep(0.3)
        llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
        events = [e for f in sub.frames(idle=1.0) for e in EventDecoder().decode(f)]
    llm.shutdown()
    seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == vllm_block_hashes(ids, 16, "sha256_cbor", seed=seed) != vllm_block_hashes(ids, 16, seed=seed)
    with pytest.raises(ValueError, match=r"use one of \('sha256', 'sha256_cbor'\)"):
        EngineArgs(prefix_caching_hash_algo="xxhash")
    ns = make_parser().parse_args(["serve", "--prefix-caching-hash-algo", "sha256_cbor"])
    assert ns.prefix_caching_hash_algo == "sha256_cbor"

def test_publisher_frames_and_replay(tmp_path):
    import zmq
    endpoint, replay = f"ipc://{tmp_path}/pub.ipc", f"ipc://{tmp_path}/replay.ipc"
    pub = make_event_publisher({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
                                "buffer_steps": 2, "topic": "kv"})
    stored = BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None, [None, None], 0, "full_attention")
    with KVEventSubscriber(endpoint, topic="kv") as sub:
        time.sleep(0.3)
        for ev in (stored, BlockRemoved([2], "GPU", 0), AllBlocksCleared()): pub.publish([ev])
        got = list(sub.frames(idle=0.5))
    assert [f.seq for f in got] == [0, 1, 2]
    assert [e for f in got for e in EventDecoder().decode(f)] == [stored, BlockRemoved([2], "GPU", 0), AllBlocksCleared()]
    batch = msgspec.msgpack.decode(got[0].payload)                     # vLLM >= 0.26's wire form
    assert batch[2] == 0 and batch[1][0]["type"] == "BlockStored" and batch[1][0]["medium"] == "GPU"
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while not seqs or seqs[-1] != -1:
        assert dealer.poll(5000)
        seqs.append(int.from_bytes(dealer.recv_multipart()[1], "big", signed=True))
    dealer.close(linger=0)
    pub.shutdown()
    assert seqs == [1, 2, -1]                                         # only the last buffer_steps batches are kept

def test_kv_events_config_is_vllms():
    assert make_event_publisher(None) is None and make_event_publisher({"publisher": "zmq"}) is None   # events off
    assert type(make_event_publisher({"enable_kv_cache_events": True, "publisher": "null"})).__name__ == "NullEventPublisher"
    assert kv_events_config('{"enable_kv_cache_events": true}').publisher == "zmq"
    with pytest.raises(ValueError, match="unknown fields"): kv_events_config({"endpoints": "tcp://*:1"})
    from pagednb.engine_args import EngineArgs
    with pytest.raises(ValueError, match="publisher='kafka' is unknown"): EngineArgs(kv_events_config={"publisher": "kafka"})
    assert msgspec.msgpack.decode(encode_batch([], ts=2.0)) == [2.0, [], 0]

def test_mirror_figure_draws_blocks_by_chain_and_medium():
    from pagednb.vllm_events import mirror_figure, mirror_layout
    m = PrefixCacheMirror(seed=META["pythonhashseed"])
    m.feed(FRAMES)
    pos = mirror_layout(m)
    assert sorted(pos.values()) == [(0, 0), (1, 0), (2, 0), (2, 1)]          # two branches off the system prompt
    m._store(BlockStored([99], None, list(range(128)), 128, medium="CPU"))    # an offloaded block of its own
    fig = mirror_figure(m, META["token_ids"][0][:256] + [42] * 200)
    assert [len(t.x) for t in fig.data[1:]] == [4, 1, 0] and fig.layout.title.text.endswith("2 blocks of the prompt held")
    assert mirror_figure(PrefixCacheMirror()).data[1].x == ()                 # nothing held: an empty figure, no error
