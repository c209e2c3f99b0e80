"""The second KV tier (`kv_offloading_size`): token-equal to Hugging Face when prefixes come back from the tier, hit
counts worked by hand, no leaked pool or tier blocks, the tier never over its size, and clear errors for bad knobs."""
import json, math, os, tempfile, time
import pytest, torch
from hypothesis import HealthCheck, given, settings, strategies as st
from pagednb.block_manager import Sequence, InvalidBlockError
from pagednb.prefix_cache import compute_block_hashes
from pagednb.kv_offload import OffloadingBlockManager, CPUOffloadTier, TierHit, DiskTier, GiB
from pagednb.engine import LLM
from pagednb.sampling import SamplingParams
from pagednb.model import load_model, resolve_model
from pagednb.engine_args import EngineArgs, add_cli_args, from_cli_args
from pagednb.metrics import Exposition, _offload_metrics
from helpers import prefill

MAX_NEW = 8
TOPICS = ["page tables", "the scheduler", "hash tables", "the TCP handshake"]

@pytest.fixture(scope="module")
def parts(): return load_model()

def _chat(tok, msgs):
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

@pytest.fixture(scope="module")
def turns(parts):
    "Two turns of four chats: the second turn's prompt starts with the first turn's (a growing history)."
    tok = parts[1]
    first = [[{"role": "user", "content": f"Tell me about {t} in an operating systems class. " * 8}] for t in TOPICS]
    second = [m + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Shorter, please."}]
              for m in first]
    return [_chat(tok, m) for m in first], [_chat(tok, m) for m in second]

@pytest.fixture(scope="module")
def reference(parts, turns):
    "Hugging Face greedy `generate` of the second turn's prompts (those whose prefixes come back), one at a time."
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()
    eos = parts[1].eos_token_id
    gen = lambda p: hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos)[0, len(p):].tolist()
    return [gen(p) for p in turns[1]]

def check_clean(llm):
    "Every pool block free or cached, no live sequence, the tier's books whole and within its size."
    bm = llm.engine.block_manager
    assert all(bm.block_state(i) in ("free", "cached") for i in range(bm.num_blocks))
    assert bm.check_invariants([])
    assert len(bm.tier.slots) <= bm.tier.num_blocks

def two_turns(llm, turns, together):
    "The first turn, then the second; `together`: each turn's prompts in one batch, else one by one."
    sp, out = SamplingParams(temperature=0, max_tokens=MAX_NEW), []
    for ps in turns:
        batches = [ps] if together else [[p] for p in ps]
        out.append([o.outputs[0].token_ids for b in batches for o in llm.generate(b, sp, use_tqdm=False)])
    return out

CASES = {   # a pool small enough to evict the first turn's prefixes, a tier large enough to keep them
    "chunked_prefill": (dict(max_model_len=256, num_gpu_blocks_override=20, max_num_batched_tokens=48), False),
    "preemption": (dict(max_model_len=192, num_gpu_blocks_override=14, max_num_batched_tokens=64), True),
}

@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_with_tier(case, parts, turns, reference):
    knobs, together = CASES[case]
    llm = LLM(parts, log=False, trace=True, kv_offloading_size=0.05, **knobs)
    assert two_turns(llm, turns, together)[1] == reference
    m = llm.get_metrics()
    assert m["external_prefix_cache_hits"] > 0 and m["kv_offload_blocks_loaded"] > 0      # prefixes came back
    per_block = llm.engine.block_manager.block_size*llm.engine.kv_bytes_per_token
    assert m["kv_offload_bytes_loaded"] == m["kv_offload_blocks_loaded"]*per_block
    if case == "chunked_prefill": assert m["prompt_tokens"] < sum(map(len, turns[0] + turns[1]))   # less computed
    if case == "preemption": assert m["num_preemptions"] > 0
    assert any("offload" in st for st in llm.trace.steps)                                 # trace events
    x = Exposition()
    _offload_metrics(x, m)                                                                # what /metrics shows
    assert f'vllm:external_prefix_cache_hits_total {m["external_prefix_cache_hits"]}' in x.text().splitlines()
    check_clean(llm)

def test_slow_copies_waited_for(parts, turns, reference, monkeypatch):
    "Copies slowed down on purpose, on the copy thread: the forward waits for each layer's, and the tokens stay HF's."
    from pagednb.runner import ModelRunner
    copy = ModelRunner._copy_layer
    def slow(self, *args):
        time.sleep(0.002)                                     # late: a forward that did not wait would read garbage
        copy(self, *args)
    monkeypatch.setattr(ModelRunner, "_copy_layer", slow)
    llm = LLM(parts, log=False, kv_offloading_size=0.05, **CASES["chunked_prefill"][0])
    assert two_turns(llm, [turns[0], turns[1][:1]], False)[1] == reference[:1]
    m = llm.get_metrics()
    assert m["kv_offload_blocks_loaded"] > 0 and m["kv_offload_blocks_stored"] > 0
    assert m["kv_offload_wait_time"] > 0                      # the forward did wait on the copy thread
    check_clean(llm)

def test_greedy_matches_hf_from_disk(parts, turns, reference, tmp_path):
    "A host tier of 2 blocks, a disk tier behind it: prefixes come back from disk; bad or deleted files are misses."
    llm = LLM(parts, log=False, trace=True, kv_offloading_size=0.0015, kv_offloading_disk_dir=str(tmp_path / "kv"),
              kv_offloading_disk_size=0.05, **CASES["chunked_prefill"][0])
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    gen = lambda p: llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    for p in turns[0]: gen(p)
    folder = llm.engine.block_manager.disk.folder
    assert gen(turns[1][0]) == reference[0]                                   # from intact files
    m = llm.get_metrics()
    assert m["kv_offload_disk_hits"] > 0 and m["kv_offload_blocks_disk_loaded"] == m["kv_offload_disk_hits"]
    for f in os.listdir(folder):                                              # one byte changed in each file
        with open(os.path.join(folder, f), "r+b") as fh:
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)[0]
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([last ^ 0xFF]))
    assert gen(turns[1][1]) == reference[1]
    for f in os.listdir(folder): os.remove(os.path.join(folder, f))
    assert gen(turns[1][2]) == reference[2] and gen(turns[1][3]) == reference[3]
    m = llm.get_metrics()
    assert m["kv_offload_disk_corrupt"] > 0 and m["kv_offload_disk_missing"] > 0, m
    x = Exposition()
    _offload_metrics(x, m)                                                    # what /metrics shows
    assert f'pagednb:kv_offload_disk_corrupt_total {m["kv_offload_disk_corrupt"]}' in x.text().splitlines()
    offs = [st["offload"] for st in llm.trace.steps if "offload" in st]                   # trace events, JSON
    assert any(o.get("spills") for o in offs) and any(o.get("disk_loads") for o in offs) and json.dumps(offs)
    check_clean(llm)

def test_tier_off_unchanged(parts, turns):
    "Without the knob: the plain prefix-caching pool, no tier metrics, no copies on the plan."
    llm = LLM(parts, log=False, max_model_len=256, num_gpu_blocks_override=20)
    assert type(llm.engine.block_manager).__name__ == "PrefixCachingBlockManager"
    assert not any(k.startswith(("kv_offload", "external_")) for k in llm.get_metrics())

# --- the books, worked by hand

def test_hits_per_tier_by_hand():
    "A's first block stays in the pool, its next two go to the tier; A again: 2 tokens from the pool, 4 from the tier."
    bm = OffloadingBlockManager(4, block_size=2, watermark=0, tier_blocks=6)
    a = Sequence(0, [1, 2, 3, 4, 5, 6, 7])
    prefill(bm, a); table = list(a.block_table); bm.deallocate(a)
    b = Sequence(1, [9, 9, 8, 8, 7])
    prefill(bm, b)
    t = bm.take_transfers()
    assert [blk for blk, _ in t.stores] == [table[2], table[1]]           # tail first, as deallocate freed them
    bm.deallocate(b)
    again = Sequence(2, [1, 2, 3, 4, 5, 6, 7])
    hits = prefill(bm, again)
    assert hits[0] == table[0] and [type(h) for h in hits[1:]] == [TierHit, TierHit]
    assert bm.prefix_cache_stats.hits == 2 and bm.offload_stats["hits"] == 4
    assert bm.prefix_cache_stats.queries == 7 + 5 + 7 and bm.offload_stats["queries"] == 19
    t = bm.take_transfers()
    assert sorted(b for _, b in t.loads) == sorted(again.block_table[1:3])
    bm.deallocate(again)
    assert bm.check_invariants([])
    bm.reset_prefix_cache()                                   # both tiers forget, nothing is stored on the way
    assert not bm.tier.slots and not bm.hash_to_block and not bm.take_transfers().stores
    assert bm.check_invariants([])

def test_stale_tier_hit_rejected():
    "A tier hit whose slot was reused since the lookup is refused, as a stale pool hit is."
    bm = OffloadingBlockManager(4, block_size=2, watermark=0, tier_blocks=1)
    a = Sequence(0, [1, 2, 3])
    prefill(bm, a); bm.deallocate(a)
    prefill(bm, Sequence(1, [5, 6, 7, 8, 9, 10, 11]))          # evicts A's block into the tier's one slot
    again = Sequence(2, [1, 2, 3])
    hits = bm.get_computed_blocks(again)
    assert isinstance(hits[0], TierHit)
    bm.tier.reset()
    with pytest.raises(InvalidBlockError, match="get_computed_blocks again"): bm.allocate(again, 1, hits)

# --- property: random traffic over a small pool and tier; K/V modelled as the hash each block or slot holds

def _prompt(family, nblocks):
    return [family % 3, 0] + [family, nblocks]*(nblocks - 1) + [99]

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4), st.booleans()), min_size=1, max_size=30),
       st.integers(4, 9), st.integers(1, 6), st.integers(0, 5))
def test_tier_property(ops, pool_blocks, tier_blocks, disk_blocks):
    "Random traffic; with `disk_blocks`, a disk tier too: files hold their hash's K/V, hits read only what was stored."
    disk = DiskTier(tempfile.gettempdir(), disk_blocks*(32 + 256)/GiB, 32) if disk_blocks else None
    bm = OffloadingBlockManager(pool_blocks, block_size=2, watermark=0, tier_blocks=tier_blocks, disk=disk)
    pool, host, files, held = {}, {}, {}, []
    for i, (family, nblocks, hold) in enumerate(ops):
        seq = Sequence(i, _prompt(family, nblocks))
        hits = bm.get_computed_blocks(seq)
        n = seq.num_tokens - len(hits)*2
        if bm.can_allocate(seq, n, hits):
            bm.allocate(seq, n, hits)
            t = bm.take_transfers()
            for where, i, h in t.spills:                               # spills to disk first, as the runner
                files[h] = host[i] if where == "host" else pool.get(i)
                disk.write(h, files[h] or b"")
            for blk, slot in t.stores: host[slot] = pool.get(blk)       # stores, then loads
            for slot, blk in t.loads: pool[blk] = host[slot]
            for payload, blk in t.disk_loads: pool[blk] = payload or None
            full = compute_block_hashes(seq, 2, seq.num_tokens//2)
            for j, blk in enumerate(seq.block_table[:len(hits)]): assert pool[blk] == full[j]   # read only loaded K/V
            for j in range(len(hits), len(full)): pool[seq.block_table[j]] = full[j]           # the forward writes
            pool[seq.block_table[-1]] = None                                                   # the partial block
            seq.num_computed_tokens = seq.num_tokens
            bm.cache_blocks(seq, seq.num_tokens)
            held.append(seq)
        while held and (not hold or len(held) > 1): bm.deallocate(held.pop(0))
        assert bm.check_invariants(held)
        assert len(bm.tier.slots) <= tier_blocks
        assert all(pool[b] == h for h, b in bm.hash_to_block.items())         # a cached block holds its hash's K/V
        assert all(host[s] == h for h, s in bm.tier.slots.items())            # and so does a tier slot
        assert disk is None or all(files[h] == h for h in disk.index)          # and a file on disk

# --- bad input

@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf"), 1e9, "4G"])
def test_bad_size(bad):
    with pytest.raises(ValueError, match="kv_offloading_size"): EngineArgs(kv_offloading_size=bad)

def test_bad_backend():
    with pytest.raises(ValueError, match="native"): EngineArgs(kv_offloading_backend="lmcache")

def test_needs_prefix_caching_and_room(parts):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(parts, log=False, kv_offloading_size=0.05, enable_prefix_caching=False, num_gpu_blocks_override=24,
            max_model_len=256)
    with pytest.raises(ValueError, match="draft model"):
        LLM(parts, log=False, kv_offloading_size=0.05, num_gpu_blocks_override=24, max_model_len=256,
            speculative_config=dict(method="draft_model", model="self", num_layers=2, num_speculative_tokens=2))
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(parts, log=False, kv_offloading_size=1e-6, num_gpu_blocks_override=24, max_model_len=256)

@pytest.mark.parametrize("knobs, match", [
    (dict(kv_offloading_disk_dir="kv", kv_offloading_disk_size=-1), "kv_offloading_disk_size=-1 is invalid"),
    (dict(kv_offloading_disk_dir="kv", kv_offloading_disk_size=math.inf), "kv_offloading_disk_size=inf is invalid"),
    (dict(kv_offloading_disk_size=1.0), "go together"),
    (dict(kv_offloading_disk_dir=3, kv_offloading_disk_size=1.0), "kv_offloading_disk_dir=3 is invalid")])
def test_bad_disk_knobs(knobs, match):
    with pytest.raises(ValueError, match=match): EngineArgs(kv_offloading_size=0.05, **knobs)
    with pytest.raises(ValueError, match="give kv_offloading_size too"):
        EngineArgs(kv_offloading_disk_dir="kv", kv_offloading_disk_size=1.0)

def test_disk_dir_not_creatable(parts, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="kv_offloading_disk_dir=.*cannot hold block files"):
        LLM(parts, log=False, kv_offloading_size=0.05, kv_offloading_disk_dir=str(tmp_path / "a_file" / "kv"),
            kv_offloading_disk_size=0.01, num_gpu_blocks_override=24, max_model_len=256)

def test_hybrid_refused():
    with pytest.raises(ValueError, match="sliding-window"): OffloadingBlockManager(8, windows=(None, 4))

def test_cli_flags():
    import argparse
    p = add_cli_args(argparse.ArgumentParser())
    ns = p.parse_args(["--kv-offloading-size", "2.5", "--kv-offloading-backend", "native"])
    knobs = from_cli_args(ns)
    assert knobs["kv_offloading_size"] == 2.5 and knobs["kv_offloading_backend"] == "native"
    knobs = from_cli_args(p.parse_args(["--kv-offloading-disk-dir", "kv", "--kv-offloading-disk-size", "2"]))
    assert (knobs["kv_offloading_disk_dir"], knobs["kv_offloading_disk_size"]) == ("kv", 2.0)
    with pytest.raises(SystemExit): p.parse_args(["--kv-offloading-backend", "lmcache"])
