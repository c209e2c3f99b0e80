import copy, math, os, random, tempfile, unittest
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from . import runner, spec_decode
from .kv_cache import kv_bytes_per_token, contiguous_waste, SMOLLM2_135M, LLAMA3_8B, LLAMA2_13B
from .block_manager import BlockManager, Sequence, compute_slot_mapping
from .prefix_cache import PrefixCachingBlockManager, compute_block_hashes, hash_block
from .scheduler import Scheduler, SchedulerConfig, Sequence as SchedSequence, SequenceStatus
from .attention import paged_attention_spec, make_paged_problem, HAS_TRITON, INTERPRETED
from .spec_decode import ngram_propose, greedy_accept, rejection_accept, first_token_histogram, chi_square
from .model import load_model
from .engine import LLM
from .sampling import SamplingParams

from fastcore.test import test_eq, test_fail

@dataclass
class Puzzle:
    "One exercise: its statement and stub, the reference answer from pagednb's code, and the cases that check it."
    name: str
    title: str
    lesson: str                      # the lesson that teaches it
    statement: str
    stub: str                        # the learner's starting point: the signature, with shapes, and an empty body
    spec: Callable                   # the reference: same arguments, the right answer
    cases: Callable = None           # random.Random -> kwargs of one random case
    edge_cases: list = field(default_factory=list)
    same: Callable = None            # (expected, got) -> None if right, else why not; default: equal as plain lists
    raises: tuple = ()               # errors the reference may raise, which the answer must raise too
    n: int = 200                     # random cases a check runs by default
    run: Callable = None             # a checker of its own (puzzle, fn, n, seed), instead of the case loop
    engine: Callable = None          # fn -> None: the answer inside a real `LLM`, against Hugging Face `generate`
    def __repr__(self): return f"Puzzle({self.name!r}: {self.title}, from {self.lesson})"

PUZZLES: dict = {}

def register(p: Puzzle) -> Puzzle:
    "Add `p` to `PUZZLES`, in teaching order."
    PUZZLES[p.name] = p
    return p

def _show(x, width=400):
    "A short repr of a case's value: tensors by shape (values when small), long bytes by their first hex digits."
    if isinstance(x, torch.Tensor):
        vals = f", {x.tolist()}" if x.numel() <= 12 else ""
        return f"tensor(shape={tuple(x.shape)}, dtype={str(x.dtype).replace('torch.', '')}{vals})"
    if isinstance(x, bytes) and len(x) > 8: return x.hex()[:8] + "…"
    if isinstance(x, (list, tuple)):
        r = ", ".join(_show(v) for v in x)
        r = f"[{r}]" if isinstance(x, list) else f"({r}{',' if len(x) == 1 else ''})"
    elif isinstance(x, dict): r = "{" + ", ".join(f"{_show(k)}: {_show(v)}" for k, v in x.items()) + "}"
    else: r = repr(x)
    return r if len(r) <= width else r[:width] + "…"

assert _show(torch.zeros(2, 3)) == "tensor(shape=(2, 3), dtype=float32, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])"
assert _show([b"\x01"*32, (1,)]) == "[01010101…, (1,)]"

def _plain(x):
    "Tensors, arrays and tuples as plain (nested) lists, so that answers of any container type compare."
    if isinstance(x, torch.Tensor): return x.tolist()
    if hasattr(x, "tolist") and not isinstance(x, (bytes, str)): return x.tolist()
    if isinstance(x, (list, tuple, deque)): return [_plain(v) for v in x]
    if isinstance(x, dict): return {k: _plain(v) for k, v in x.items()}
    return x

def _same_plain(exp, got):
    "None if `got` equals `exp` as plain lists, else a short reason."
    return None if _plain(got) == _plain(exp) else "differs"

assert _same_plain([(1, 2)], [[1, 2]]) is None and _same_plain([1], torch.tensor([2])) == "differs"

class NotSolved(AssertionError):
    "The answer raised `NotImplementedError`: the stub is still empty."

def _case_list(p, n, seed):
    "The edge cases, then `n` random ones, each labelled so that a failure can name it."
    out = [(f"edge case {i}", c) for i, c in enumerate(p.edge_cases)]
    return out + [(f"random case {i} (seed={seed})", p.cases(random.Random(seed*1_000_003 + i))) for i in range(n)]

def _reference(p, case):
    "('ok', answer) or ('raises', error type) for the reference on `case`."
    try: return "ok", p.spec(**copy.deepcopy(case))
    except p.raises as e: return "raises", next(t for t in p.raises if isinstance(e, t))

def _fail(p, label, case, expected, got):
    "Raise the `AssertionError` of a failing case."
    args = "\n".join(f"    {k} = {_show(v)}" for k, v in case.items())
    raise AssertionError(f"puzzle {p.name!r} failed on {label}:\n  inputs:\n{args}\n  expected: {expected}\n  got:      {got}")

def _attempt(p, fn, label, case):
    "('ok', answer) or ('raises', error) for the answer on a copy of `case`, and that copy afterwards."
    mine = copy.deepcopy(case)
    try: return ("ok", fn(**mine)), mine
    except NotImplementedError as e:
        raise NotSolved(f"puzzle {p.name!r}: the answer raised NotImplementedError on {label}: write its body") from e
    except Exception as e: return ("raises", e), mine

def _check_case(p, fn, label, case):
    "Compare the answer with the reference on one case; raise `AssertionError` naming it when they differ."
    (kind, exp), ((gkind, got), mine) = _reference(p, case), _attempt(p, fn, label, case)
    if kind == "raises":
        if gkind == "ok": _fail(p, label, case, f"raises {exp.__name__}", _show(got))
        if not isinstance(got, exp): _fail(p, label, case, f"raises {exp.__name__}", f"raises {got!r}")
        if _plain(mine) != _plain(case):
            _fail(p, label, case, f"raises {exp.__name__} and leaves its inputs as they were (all or nothing)",
                  f"raises, but changed its inputs to {_show(mine)}")
        return
    if gkind == "raises": _fail(p, label, case, _show(exp), f"raises {got!r}")
    why = (p.same or _same_plain)(exp, got)
    if why: _fail(p, label, case, _show(exp), f"{_show(got)}   ({why})")

def check(name: str, fn: Callable, n: int = None, seed: int = 0, engine: bool = False) -> bool:
    "Check `fn` against puzzle `name` on its edge cases and `n` random ones (and, with `engine`, in a real `LLM`)."
    p = get_puzzle(name)
    n = p.n if n is None else n
    if p.run: p.run(p, fn, n, seed)
    else:
        for label, case in _case_list(p, n, seed): _check_case(p, fn, label, case)
    if engine:
        if p.engine is None:
            raise ValueError(f"puzzle {name!r} has no engine check; these do: {[k for k, q in PUZZLES.items() if q.engine]}")
        p.engine(fn)
    return True

def get_puzzle(name: str) -> Puzzle:
    "The puzzle called `name`, or a `KeyError` that lists the names."
    if name not in PUZZLES: raise KeyError(f"no puzzle {name!r}; the puzzles are {list(PUZZLES)}")
    return PUZZLES[name]

def try_check(name: str, fn: Callable, **kwargs) -> bool:
    "`check`, but an empty stub (`NotImplementedError`) or a missing Triton prints why instead of raising."
    try: check(name, fn, **kwargs)
    except NotSolved as e: print(f"not solved yet: {e}"); return False
    except unittest.SkipTest as e: print(f"skipped: {e}"); return False
    print(f"solved: {name!r} passed its checks")
    return True

def _config_case(rng):
    "A random Llama-family config: sometimes without `num_key_value_heads`, sometimes with a `head_dim` of its own."
    heads = rng.choice([4, 8, 9, 12, 16, 32, 40, 64])
    cfg = dict(num_hidden_layers=rng.randint(1, 80), num_attention_heads=heads, hidden_size=heads*rng.choice([32, 64, 128]))
    if rng.random() < 0.7: cfg["num_key_value_heads"] = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    if rng.random() < 0.3: cfg["head_dim"] = rng.choice([64, 128, 256])
    return dict(cfg=cfg, dtype_bytes=rng.choice([1, 2, 4]))

QWEN3_LIKE = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, hidden_size=1024, head_dim=128)

register(Puzzle("kv_bytes_per_token", "Bytes of one token's KV cache", "00_kv_cache",
    "Every layer stores one K and one V vector per KV head for each token. Return the bytes one token occupies "
    "across all layers. `num_key_value_heads` defaults to `num_attention_heads`; `head_dim`, when the config has "
    "none, is `hidden_size // num_attention_heads`.",
    'def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:\n'
    '    "Bytes of K and V one token occupies in all layers of the model `cfg`."\n'
    '    raise NotImplementedError',
    spec=lambda cfg, dtype_bytes: kv_bytes_per_token(cfg, dtype_bytes), cases=_config_case,
    edge_cases=[dict(cfg=dict(SMOLLM2_135M), dtype_bytes=2), dict(cfg=dict(LLAMA3_8B), dtype_bytes=2),
                dict(cfg=dict(LLAMA2_13B), dtype_bytes=2), dict(cfg=dict(QWEN3_LIKE), dtype_bytes=2),
                dict(cfg=dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64), dtype_bytes=4)]))

assert check("kv_bytes_per_token", lambda cfg, dtype_bytes: kv_bytes_per_token(cfg, dtype_bytes))
test_fail(lambda: check("kv_bytes_per_token", lambda cfg, dtype_bytes: cfg["num_hidden_layers"]*cfg["hidden_size"]*dtype_bytes), contains="edge case 0")
test_fail(lambda: check("kv_bytes_per_token", lambda cfg, dtype_bytes: cfg["num_hidden_layers"]*cfg["hidden_size"]*dtype_bytes), contains="expected: 23040")

def _workload_case(rng):
    "A random mix of `(prompt_len, output_len)` requests under a random `max_model_len`."
    mml = rng.choice([64, 256, 1024, 2048, 4096])
    wl = []
    for _ in range(rng.randint(1, 20)):
        p = rng.randint(1, mml - 1)
        wl.append((p, rng.randint(1, mml - p)))
    return dict(workload=wl, max_model_len=mml)

def _same_float(exp, got):
    return None if isinstance(got, (int, float)) and math.isclose(got, exp, rel_tol=1e-9, abs_tol=1e-12) else "differs"

register(Puzzle("contiguous_waste", "The waste of contiguous reservation", "00_kv_cache",
    "A server without paging reserves `max_model_len` KV slots for every request, up front. Each request of the "
    "workload is `(prompt_len, output_len)` and uses `prompt_len + output_len` slots. Return the fraction of reserved "
    "slots that are never used. A request longer than `max_model_len` cannot be served: raise `ValueError`.",
    'def contiguous_waste(workload: list[tuple[int, int]], max_model_len: int) -> float:\n'
    '    "Fraction of reserved KV slots never used, when each request reserves max_model_len."\n'
    '    raise NotImplementedError',
    spec=contiguous_waste, cases=_workload_case, same=_same_float, raises=(ValueError,),
    edge_cases=[dict(workload=[(1000, 1048)], max_model_len=2048), dict(workload=[(1, 1)], max_model_len=2048),
                dict(workload=[(200, 300), (50, 10), (900, 100)], max_model_len=1024),
                dict(workload=[(10, 10), (1000, 30)], max_model_len=1024)]))

assert check("contiguous_waste", contiguous_waste)
test_fail(lambda: check("contiguous_waste", lambda workload, max_model_len: 1 - sum(p for p, o in workload)/(len(workload)*max_model_len)), contains="edge case 0")

def _slots_case(rng):
    "A block table of distinct physical blocks, and positions inside it: a chunk `[start, end)`, or scattered ones."
    bs = rng.choice([1, 2, 4, 8, 16])
    table = rng.sample(range(64), rng.randint(1, 6))
    n = len(table)*bs
    if rng.random() < 0.6:
        a = rng.randrange(n)
        pos = list(range(a, rng.randint(a + 1, n)))
    else: pos = sorted(rng.sample(range(n), rng.randint(1, n)))
    return dict(block_table=table, positions=pos, block_size=bs)

def _slots_spec(block_table, positions, block_size):
    "pagednb's `compute_slot_mapping`, on lists."
    if not positions: return []
    return compute_slot_mapping(torch.tensor(block_table), torch.tensor(positions), block_size).tolist()

SLOT_STUB = ('def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:\n'
             '    "The cache slot of each token position: its physical block times block_size, plus its offset."\n'
             '    raise NotImplementedError')

@lru_cache(maxsize=1)
def tiny_model():
    "A tiny random-weight Llama: pagednb's `(model, tokenizer, config)`, and the same weights in Hugging Face."
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    path = tempfile.mkdtemp(prefix="pagednb-puzzle-model-")
    hf.save_pretrained(path)
    return load_model(path, dtype="float32", device="cpu"), hf

def hf_greedy(hf, prompts, max_tokens):
    "Hugging Face greedy `generate`, one prompt at a time, exactly `max_tokens` new tokens each."
    outs = []
    for p in prompts:
        x = torch.tensor([p])
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                        do_sample=False, pad_token_id=0)
        outs.append(y[0, len(p):].tolist())
    return outs

def engine_matches_hf(prompts, max_tokens=8, **knobs):
    "Generate greedily with a real `LLM` on `tiny_model()`; `AssertionError` naming the first prompt that differs from HF."
    parts, hf = tiny_model()
    llm = LLM(parts, log=False, attention_backend="torch", block_size=4, max_model_len=96, num_gpu_blocks_override=48,
              max_num_batched_tokens=16, **knobs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    for i, (p, o, ref) in enumerate(zip(prompts, outs, hf_greedy(hf, prompts, max_tokens))):
        got = list(o.outputs[0].token_ids)
        assert got == ref, f"engine check: prompt {i} ({len(p)} tokens) generated {got}, but Hugging Face generates {ref}"
    return llm

ENGINE_PROMPTS = [[(7*i + 3) % 128 for i in range(n)] for n in (5, 13, 22)]

def _slots_engine(fn):
    "The answer as the runner's `token_slots` for one `generate`: greedy tokens must equal Hugging Face's."
    def token_slots(block_tables, rows, positions, block_size):
        out = torch.empty_like(positions, dtype=torch.long)
        for r in rows.unique().tolist():
            m = rows == r
            out[m] = torch.as_tensor(_plain(fn(block_tables[r].tolist(), positions[m].tolist(), block_size)), dtype=torch.long)
        return out
    saved, runner.token_slots = runner.token_slots, token_slots
    try: engine_matches_hf(ENGINE_PROMPTS, enable_prefix_caching=False)
    finally: runner.token_slots = saved

register(Puzzle("slot_mapping", "Slot mapping", "02_block_manager",
    "The paged cache is one flat array of `num_blocks * block_size` slots. A sequence's block table maps its "
    "logical block `i` (positions `i*block_size` to `(i+1)*block_size - 1`) to a physical block. Return the slot "
    "of each position.",
    SLOT_STUB, spec=_slots_spec, cases=_slots_case, engine=_slots_engine,
    edge_cases=[dict(block_table=[7, 3], positions=[3, 4], block_size=4), dict(block_table=[5], positions=[], block_size=4),
                dict(block_table=[2, 0, 9], positions=[0, 1, 2], block_size=1),
                dict(block_table=[6, 1, 4], positions=list(range(5, 16)), block_size=8)]))

assert check("slot_mapping", _slots_spec)
test_fail(lambda: check("slot_mapping", lambda block_table, positions, block_size: [block_table[p//block_size] + p % block_size for p in positions]), contains="edge case 0")
test_fail(lambda: check("slot_mapping", lambda block_table, positions, block_size: [block_table[p//block_size] + p % block_size for p in positions]), contains="expected: [31, 12]")

def _manager(cls, block_size, num_blocks, free_blocks, ref_counts=None):
    "A `cls` block manager in a given state: `free_blocks` in queue order; every other block held `ref_counts[b]` times (1)."
    bm = cls(num_blocks, block_size, watermark=0.0)
    bm.free_block_ids = deque(free_blocks)
    free = set(free_blocks)
    for b in bm.blocks:
        if b.block_id not in free: b.ref_count = ref_counts[b.block_id] if ref_counts else 1
    bm._num_used = sum(1 for b in bm.blocks if b.ref_count)
    return bm

def _seq_in(bm, block_table, num_computed_tokens, num_tokens):
    "A live sequence 0 of `bm` holding `block_table`, with `num_computed_tokens` computed."
    seq = Sequence(0, [0]*num_tokens)
    seq.block_table, seq.num_computed_tokens = list(block_table), num_computed_tokens
    bm.seqs[0] = seq
    return seq

def _allocate_spec(block_table, free_blocks, num_computed_tokens, num_new_tokens, block_size):
    "The block table and free queue after `BlockManager.allocate` of `num_new_tokens`."
    num_blocks = max(block_table + free_blocks + [0]) + 1
    bm = _manager(BlockManager, block_size, num_blocks, free_blocks)
    seq = _seq_in(bm, block_table, num_computed_tokens, num_computed_tokens + num_new_tokens)
    bm.allocate(seq, num_new_tokens)
    return seq.block_table, list(bm.free_block_ids)

def _allocate_case(rng):
    "A sequence part way through, a free queue in random order, and 0 to 3 blocks' worth of new tokens (often one)."
    bs = rng.choice([1, 2, 4, 8, 16])
    ids = rng.sample(range(24), rng.randint(2, 24))
    nc = rng.randint(0, 4*bs)
    held = -(-nc//bs) + (rng.random() < 0.15)
    table, rest = ids[:held], ids[held:]
    free = rng.sample(rest, rng.randint(0, len(rest)))
    new = 1 if rng.random() < 0.4 else rng.randint(0, 3*bs)
    return dict(block_table=table, free_blocks=free, num_computed_tokens=nc, num_new_tokens=new, block_size=bs)

register(Puzzle("allocate", "Allocate and append a slot with a free queue", "02_block_manager",
    "A sequence holds `block_table` and has `num_computed_tokens` tokens in the cache. It is about to compute "
    "`num_new_tokens` more (a prompt chunk, or one decode token: append a slot). Grow its block table so it covers "
    "every position it will then hold, taking blocks from the front of the free queue. Return the new block table "
    "and free queue. All or nothing: if too few blocks are free, raise `MemoryError` and change nothing.",
    'def allocate(block_table: list[int], free_blocks: list[int], num_computed_tokens: int, num_new_tokens: int,\n'
    '             block_size: int) -> tuple[list[int], list[int]]:\n'
    '    "(block table, free queue) after making room for num_new_tokens more tokens; MemoryError if they do not fit."\n'
    '    raise NotImplementedError',
    spec=_allocate_spec, cases=_allocate_case, raises=(MemoryError,),
    edge_cases=[dict(block_table=[], free_blocks=[3, 1, 2], num_computed_tokens=0, num_new_tokens=5, block_size=4),
                dict(block_table=[5], free_blocks=[2, 0], num_computed_tokens=4, num_new_tokens=1, block_size=4),
                dict(block_table=[5], free_blocks=[2, 0], num_computed_tokens=3, num_new_tokens=1, block_size=4),
                dict(block_table=[4], free_blocks=[1], num_computed_tokens=4, num_new_tokens=5, block_size=4),
                dict(block_table=[0, 6], free_blocks=[1], num_computed_tokens=5, num_new_tokens=0, block_size=4)]))

assert check("allocate", _allocate_spec)

def _cow_spec(block_table, ref_counts, free_blocks, num_computed_tokens, num_new_tokens, block_size):
    "Block table, ref counts, free queue and copies after `BlockManager.allocate` on a sequence with shared blocks."
    bm = _manager(BlockManager, block_size, len(ref_counts), free_blocks, ref_counts)
    seq = _seq_in(bm, block_table, num_computed_tokens, num_computed_tokens + num_new_tokens)
    out = bm.allocate(seq, num_new_tokens)
    return seq.block_table, bm.ref_counts, list(bm.free_block_ids), out.copies

def _cow_case(rng):
    "A forked sequence: some of its blocks shared (ref count 2 or 3), the free blocks in random order."
    bs = rng.choice([1, 2, 4, 8])
    N = rng.randint(3, 16)
    ids = rng.sample(range(N), N)
    nc = rng.randint(1, min(4*bs, (N - 1)*bs))
    held = -(-nc//bs) + (rng.random() < 0.15)
    table, rest = ids[:held], ids[held:]
    free = rng.sample(rest, rng.randint(0, len(rest)))
    refs = [0 if b in free else 1 for b in range(N)]
    for b in table: refs[b] = rng.choice([1, 2, 2, 3])
    new = 1 if rng.random() < 0.5 else rng.randint(1, 2*bs)
    return dict(block_table=table, ref_counts=refs, free_blocks=free, num_computed_tokens=nc, num_new_tokens=new, block_size=bs)

register(Puzzle("copy_on_write", "Fork with copy-on-write", "02_block_manager",
    "`fork` gave a child its parent's block table and added one to each block's `ref_counts[b]`: the blocks are "
    "shared. Now this sequence computes `num_new_tokens` tokens from position `num_computed_tokens`. A block it is "
    "about to write that is shared (ref count > 1) must first be replaced by its own block from the front of the "
    "free queue (the old block loses a reference); if the old block already holds computed K/V, the runner must "
    "copy it: record `(old, new)`. Then append new blocks as in `allocate` (copies first, then appends, from the "
    "queue). Return the block table, the ref counts, the free queue and the copies. All or nothing: `MemoryError`.",
    'def copy_on_write(block_table: list[int], ref_counts: list[int], free_blocks: list[int], num_computed_tokens: int,\n'
    '                  num_new_tokens: int, block_size: int) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:\n'
    '    "(block table, ref counts, free queue, copies) after making this sequence\'s next writes private."\n'
    '    raise NotImplementedError',
    spec=_cow_spec, cases=_cow_case, raises=(MemoryError,),
    edge_cases=[dict(block_table=[4, 7], ref_counts=[0, 1, 0, 1, 2, 0, 1, 2], free_blocks=[5, 2, 0],
                     num_computed_tokens=6, num_new_tokens=1, block_size=4),
                dict(block_table=[4, 7], ref_counts=[0, 1, 0, 1, 2, 0, 1, 2], free_blocks=[5, 2, 0],
                     num_computed_tokens=8, num_new_tokens=1, block_size=4),
                dict(block_table=[4, 7], ref_counts=[0, 1, 0, 1, 2, 0, 1, 1], free_blocks=[5, 2, 0],
                     num_computed_tokens=5, num_new_tokens=1, block_size=4),
                dict(block_table=[4, 7], ref_counts=[0, 1, 0, 1, 1, 0, 1, 2], free_blocks=[5, 2, 0],
                     num_computed_tokens=4, num_new_tokens=2, block_size=4),
                dict(block_table=[4, 7], ref_counts=[1, 1, 1, 1, 2, 1, 1, 2], free_blocks=[],
                     num_computed_tokens=6, num_new_tokens=1, block_size=4)]))

assert check("copy_on_write", _cow_spec)
test_out = _cow_spec(**get_puzzle("copy_on_write").edge_cases[0])
assert test_out == ([4, 5], [0, 1, 0, 1, 2, 1, 1, 1], [2, 0], [(7, 5)]), test_out

def _hashes_spec(token_ids, block_size, cache_salt=None):
    "pagednb's `compute_block_hashes` over every full block."
    return compute_block_hashes(Sequence(0, token_ids, cache_salt), block_size, len(token_ids)//block_size)

def _hashes_case(rng):
    "Tokens from a small vocabulary (blocks repeat), sometimes a cache salt."
    bs = rng.choice([1, 2, 4, 8])
    toks = [rng.randrange(5) for _ in range(rng.randint(0, 5*bs + 3))]
    return dict(token_ids=toks, block_size=bs, cache_salt=rng.choice([None, None, "tenant-a", "tenant-b"]))

register(Puzzle("block_hashes", "The hash chain of full blocks", "03_prefix_cache",
    "A full block is found again by a hash of everything up to and including it: block `i`'s hash is "
    "`hash_block(parent, its token ids, extra_keys)`, where `parent` is block `i-1`'s hash (`None` for block 0). "
    "The last block, if not full, gets no hash. A `cache_salt` isolates tenants: it is block 0's only extra key, "
    "`(cache_salt,)`; later blocks inherit it through the chain. Use `pagednb.prefix_cache.hash_block`.",
    'from pagednb.prefix_cache import hash_block\n\n'
    'def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:\n'
    '    "The hash of each full block of token_ids, each chained to its parent\'s."\n'
    '    raise NotImplementedError',
    spec=_hashes_spec, cases=_hashes_case,
    edge_cases=[dict(token_ids=[1, 2, 3, 4, 1, 2, 3, 4, 9], block_size=4, cache_salt=None),
                dict(token_ids=[1, 2, 3], block_size=4, cache_salt=None),
                dict(token_ids=[5, 5, 5, 5, 5, 5, 5, 5], block_size=2, cache_salt=None),
                dict(token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4, cache_salt="tenant-a")]))

assert check("block_hashes", _hashes_spec)

def _admit_spec(block_hashes, num_tokens, block_size, hash_to_block, free_blocks, cached_free):
    "(hits, new blocks) of a new sequence admitted into a `PrefixCachingBlockManager` in the given state."
    ids = list(hash_to_block.values()) + free_blocks + cached_free
    bm = _manager(PrefixCachingBlockManager, block_size, max(ids + [0]) + 1, free_blocks)
    for h, b in hash_to_block.items(): bm.blocks[b].block_hash = h
    bm.hash_to_block = dict(hash_to_block)
    for b in cached_free: bm.blocks[b].ref_count = 0
    bm.cached_free = OrderedDict((b, None) for b in cached_free)
    bm._num_used = sum(1 for b in bm.blocks if b.ref_count)
    seq = Sequence(0, [0]*num_tokens)
    seq.block_hashes = list(block_hashes)
    hits = bm.get_computed_blocks(seq)
    return hits, bm.allocate(seq, num_tokens - len(hits)*block_size, hits).new_blocks

def _admit_case(rng):
    "A prompt whose hash chain is partly cached (some of it in blocks nobody holds), a tight pool, a random LRU order."
    bs = rng.choice([2, 4, 8])
    k = rng.randint(0, 5)
    num_tokens = max(1, k*bs + (0 if rng.random() < 0.35 else rng.randint(1, bs - 1)))
    hashes = [f"p{i}".encode() for i in range(num_tokens//bs)]
    cached = hashes[:rng.randint(0, len(hashes))] + [h for h in hashes if rng.random() < 0.2] + [b"x0", b"x1"][:rng.randint(0, 2)]
    cached = list(dict.fromkeys(cached))
    N = len(cached) + rng.randint(0, 4) + rng.randint(0, 3)
    ids = rng.sample(range(N), N)
    h2b = dict(zip(cached, ids))
    rest = ids[len(cached):]
    cached_free = [b for b in h2b.values() if rng.random() < 0.6]
    rng.shuffle(cached_free)
    free = rng.sample(rest, rng.randint(0, len(rest)))
    return dict(block_hashes=hashes, num_tokens=num_tokens, block_size=bs, hash_to_block=h2b, free_blocks=free,
                cached_free=cached_free)

register(Puzzle("prefix_lookup", "The longest cached prefix, and LRU eviction", "03_prefix_cache",
    "A new prompt of `num_tokens` tokens has the hash chain `block_hashes` (one per full block). `hash_to_block` "
    "maps each cached hash to its block. Its hits are the blocks of the longest run of its hashes, from block 0, "
    "found in `hash_to_block`, but at most `(num_tokens - 1) // block_size` of them: the last token is always "
    "computed, to get its logits. The rest of the prompt needs new blocks: from the front of `free_blocks` first, "
    "then by evicting the least recently used of `cached_free` (cached blocks nobody holds, LRU first). A hit in "
    "`cached_free` is taken back, so it cannot be evicted. Return `(hits, new_blocks)`; `MemoryError` if too few.",
    'def prefix_lookup(block_hashes: list[bytes], num_tokens: int, block_size: int, hash_to_block: dict[bytes, int],\n'
    '                  free_blocks: list[int], cached_free: list[int]) -> tuple[list[int], list[int]]:\n'
    '    "(prefix-cache hits, new blocks in the order taken) when admitting this prompt."\n'
    '    raise NotImplementedError',
    spec=_admit_spec, cases=_admit_case, raises=(MemoryError,),
    edge_cases=[dict(block_hashes=[b"p0", b"p1"], num_tokens=10, block_size=4, hash_to_block={b"p0": 3, b"p1": 0, b"x0": 2},
                     free_blocks=[], cached_free=[2, 0, 3]),
                dict(block_hashes=[b"p0", b"p1"], num_tokens=8, block_size=4, hash_to_block={b"p0": 3, b"p1": 0},
                     free_blocks=[1], cached_free=[0]),
                dict(block_hashes=[b"p0", b"p1", b"p2"], num_tokens=13, block_size=4, hash_to_block={b"p0": 1, b"p2": 2},
                     free_blocks=[0], cached_free=[2, 1]),
                dict(block_hashes=[b"p0"], num_tokens=6, block_size=4, hash_to_block={b"x0": 1, b"x1": 2},
                     free_blocks=[], cached_free=[2, 1])]))

assert check("prefix_lookup", _admit_spec)
assert _admit_spec(**get_puzzle("prefix_lookup").edge_cases[0]) == ([3, 0], [2])

def _scheduler(running, waiting, budget, max_num_seqs, block_size, num_free_blocks=None):
    "A `Scheduler` in the given state; without `num_free_blocks` the pool has room for everything."
    held = sum(-(-nc//block_size) for _, _, nc in running)
    free = sum(-(-(nt + 1)//block_size) for _, nt, _ in running) + sum(-(-nt//block_size) + 1 for _, nt in waiting)
    bm = BlockManager(held + (free if num_free_blocks is None else num_free_blocks), block_size, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=4096), bm)
    for sid, nt, nc in running:
        s = SchedSequence(sid, [0]*nt)
        bm.allocate(s, nc)
        s.num_computed_tokens, s.status = nc, SequenceStatus.RUNNING
        sched.running.append(s)
    for sid, nt in waiting: sched.add(SchedSequence(sid, [0]*nt))
    return sched

def _step_spec(running, waiting, max_num_batched_tokens, max_num_seqs):
    "`[(seq_id, num_new_tokens)]` of the real `Scheduler.schedule()`, in the order it schedules them."
    plan = _scheduler(running, waiting, max_num_batched_tokens, max_num_seqs, 16).schedule()
    return [(s.seq.seq_id, s.num_new_tokens) for s in plan.scheduled]

def _running_case(rng, n, first_id=0):
    "`n` running sequences: mostly decodes (one token left), some part way through their prompt."
    out = []
    for i in range(n):
        nt = rng.randint(2, 80)
        out.append((first_id + i, nt, nt - 1 if rng.random() < 0.6 else rng.randint(0, nt - 2)))
    return out

def _step_case(rng):
    "Running and waiting sequences, a token budget from tight to loose, and a seat limit."
    running = _running_case(rng, rng.randint(0, 6))
    waiting = [(len(running) + i, rng.randint(1, 120)) for i in range(rng.randint(0, 4))]
    if not running and not waiting: waiting = [(0, rng.randint(1, 120))]
    return dict(running=running, waiting=waiting, max_num_batched_tokens=rng.choice([1, 4, 16, 32, 64, 256]),
                max_num_seqs=rng.randint(max(1, len(running)), len(running) + 4))

register(Puzzle("schedule_step", "One scheduler step under a token budget", "05_scheduler",
    "Plan one step. Running sequences go first, decodes (exactly one uncomputed token) before prompt chunks, "
    "otherwise in arrival order; each gets `min(its uncomputed tokens, budget left)`. Then waiting sequences are "
    "admitted in order while budget is left and fewer than `max_num_seqs` sequences run, each with a chunk of its "
    "prompt of at most the budget left (chunked prefill). Return `[(seq_id, num_new_tokens)]` in scheduling order.",
    'def schedule_step(running: list[tuple[int, int, int]], waiting: list[tuple[int, int]], max_num_batched_tokens: int,\n'
    '                  max_num_seqs: int) -> list[tuple[int, int]]:\n'
    '    "[(seq_id, num_new_tokens)] of one step, in the order they are scheduled."\n'
    '    raise NotImplementedError',
    spec=_step_spec, cases=_step_case,
    edge_cases=[dict(running=[(0, 50, 10), (1, 30, 29), (2, 20, 19)], waiting=[(3, 40)], max_num_batched_tokens=16, max_num_seqs=8),
                dict(running=[(0, 9, 8), (1, 9, 8)], waiting=[(2, 100), (3, 5)], max_num_batched_tokens=32, max_num_seqs=8),
                dict(running=[(0, 9, 8)], waiting=[(1, 10), (2, 10)], max_num_batched_tokens=64, max_num_seqs=2),
                dict(running=[(0, 9, 8), (1, 9, 8), (2, 9, 8)], waiting=[(3, 10)], max_num_batched_tokens=2, max_num_seqs=8)]))

assert check("schedule_step", _step_spec)
assert _step_spec(**get_puzzle("schedule_step").edge_cases[0]) == [(1, 1), (2, 1), (0, 14)]

def _preempt_spec(running, num_free_blocks, block_size, max_num_batched_tokens):
    "(preempted seq ids, tokens of K/V they threw away) of one real `Scheduler.schedule()` over a tight pool."
    computed = {sid: nc for sid, _, nc in running}
    plan = _scheduler(running, [], max_num_batched_tokens, 64, block_size, num_free_blocks).schedule()
    return plan.preempted, sum(computed[s] for s in plan.preempted)

def _preempt_case(rng):
    "Running sequences each holding the blocks of their computed tokens, and 0 to 2 free blocks."
    bs = rng.choice([2, 4, 8])
    running = []
    for i in range(rng.randint(1, 6)):
        nt = rng.randint(2, 6*bs)
        if rng.random() < 0.4: nt = bs*rng.randint(1, 5) + 1              # a decode that needs a new block
        nc = nt - 1 if rng.random() < 0.7 else rng.randint(1, nt - 1)
        running.append((i, nt, nc))
    return dict(running=running, num_free_blocks=rng.randint(0, 2), block_size=bs, max_num_batched_tokens=rng.choice([8, 64]))

register(Puzzle("preempt", "The preemption victim, and what recompute costs", "05_scheduler",
    "The same step as `schedule_step`, with no waiting sequences, but now the pool is tight: each running sequence "
    "`(seq_id, num_tokens, num_computed_tokens)` holds the blocks of its computed tokens and only `num_free_blocks` "
    "are free. When a sequence's new tokens need more blocks than are free, preempt the newest-arriving running "
    "sequence not yet scheduled this step (itself, if there is no other): all its blocks are freed and it goes "
    "back to waiting; repeat until it fits. Return `(preempted seq ids in order, tokens whose K/V was thrown away)`: "
    "those tokens will be computed again when the sequence is readmitted.",
    'def preempt(running: list[tuple[int, int, int]], num_free_blocks: int, block_size: int,\n'
    '            max_num_batched_tokens: int) -> tuple[list[int], int]:\n'
    '    "(seq ids preempted in this step, in order; tokens of K/V discarded that must be recomputed)."\n'
    '    raise NotImplementedError',
    spec=_preempt_spec, cases=_preempt_case,
    edge_cases=[dict(running=[(0, 9, 8), (1, 5, 4), (2, 13, 12)], num_free_blocks=1, block_size=4, max_num_batched_tokens=64),
                dict(running=[(0, 9, 8), (1, 20, 3)], num_free_blocks=0, block_size=4, max_num_batched_tokens=64),
                dict(running=[(0, 20, 3), (1, 9, 8)], num_free_blocks=0, block_size=4, max_num_batched_tokens=64),
                dict(running=[(0, 9, 8)], num_free_blocks=0, block_size=4, max_num_batched_tokens=64)]))

assert check("preempt", _preempt_spec)
assert _preempt_spec(**get_puzzle("preempt").edge_cases[0]) == ([2], 12)

def _attention_spec(query, k_cache, v_cache, block_tables, seq_lens, scale):
    "`paged_attention_spec` with one query token per sequence."
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=query.device)
    return paged_attention_spec(query, k_cache, v_cache, block_tables, seq_lens, qsl, scale)

def _paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed, device="cpu"):
    "A decode batch from `make_paged_problem`, its new K/V written, as the puzzle's arguments."
    p = make_paged_problem(seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           block_size=block_size, seed=seed, device=device)
    p.fill()
    return dict(query=p.query, k_cache=p.k_cache, v_cache=p.v_cache, block_tables=p.block_tables, seq_lens=p.seq_lens,
                scale=p.scale)

def _attention_case(rng, max_len=70, device="cpu"):
    "1 to 4 sequences of random lengths; heads with grouped-query attention or without."
    kvh = rng.choice([1, 2, 4])
    return _paged_case([rng.randint(1, max_len) for _ in range(rng.randint(1, 4))], kvh*rng.choice([1, 2, 4]), kvh,
                       rng.choice([8, 16, 32]), rng.choice([1, 4, 8, 16]), rng.randrange(10**6), device)

def _same_tensor(exp, got):
    "None if `got` is a tensor of `exp`'s shape, without NaN, close to it; else why not."
    if not isinstance(got, torch.Tensor): return f"not a tensor but a {type(got).__name__}"
    if got.shape != exp.shape: return f"shape {tuple(got.shape)}, expected {tuple(exp.shape)}"
    if got.float().isnan().any(): return "NaN in the output: it read a cache slot that holds no token (they are NaN)"
    err = (got.float() - exp.float()).abs().max().item()
    return None if err <= 1e-4 + 1e-4*exp.float().abs().max().item() else f"max abs error {err:.3g}"

DECODE_STUB = ('def paged_decode(query: "[S, H, D]", k_cache: "[num_blocks, block_size, KVH, D]",\n'
               '                 v_cache: "[num_blocks, block_size, KVH, D]", block_tables: "[S, max_blocks] int32",\n'
               '                 seq_lens: "[S] int32", scale: float) -> "[S, H, D]":\n'
               '    "Attention of each sequence\'s one query token over its seq_len cached tokens, read through its block table."\n'
               '    raise NotImplementedError')

register(Puzzle("paged_attention", "Paged decode attention in torch", "04_paged_attention",
    "Each of the `S` sequences has one query token (its last position) and `seq_lens[s]` tokens of K/V in the "
    "paged cache, its new token included: position `i` lives at block `block_tables[s, i // block_size]`, offset "
    "`i % block_size`. Query head `h` attends with KV head `h // (H // KVH)` (grouped-query attention). Return "
    "`softmax(q . k * scale) @ v` per sequence and head, computed in float32, in the query's dtype. Entries of "
    "`block_tables` past a sequence's last block are padding, and slots past `seq_lens[s]` hold NaN.",
    DECODE_STUB, spec=_attention_spec, cases=_attention_case, same=_same_tensor, n=40,
    edge_cases=[_paged_case([1], 4, 2, 16, 4, 1), _paged_case([16, 5], 4, 4, 16, 16, 2), _paged_case([9, 3, 17], 8, 2, 8, 1, 3),
                _paged_case([33], 2, 1, 32, 8, 4)]))

assert check("paged_attention", _attention_spec)

def _triton_device():
    "Where the kernel can run: the GPU, or the CPU through the interpreter; `SkipTest` if neither."
    if not HAS_TRITON: raise unittest.SkipTest("Triton is not installed (pip install triton; on CPU it runs interpreted)")
    if INTERPRETED: return "cpu"
    if torch.cuda.is_available(): return "cuda"
    raise unittest.SkipTest("no GPU, and Triton was imported without TRITON_INTERPRET=1: set it before importing triton")

def _kernel_run(p, fn, n, seed):
    "Puzzle 10's comparison on the edge cases and `n` tiny random cases, on the kernel's device."
    dev = _triton_device()
    cases = [(f"edge case {i}", _paged_case(*c, device=dev)) for i, c in enumerate(KERNEL_EDGES)]
    cases += [(f"random case {i} (seed={seed})", _attention_case(random.Random(seed*1_000_003 + i), 24, dev)) for i in range(n)]
    for label, case in cases: _check_case(p, fn, label, case)

KERNEL_EDGES = [([1, 7], 4, 2, 16, 4, 11), ([8, 13, 4], 4, 1, 16, 4, 12), ([5], 2, 2, 8, 8, 13)]

KERNEL_STUB = ('import triton, triton.language as tl\n\n'
               '@triton.jit\n'
               'def paged_decode_kernel(Q, K, V, O, BLOCK_TABLES, SEQ_LENS, scale, bt_stride,\n'
               '                        H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):\n'
               '    s, h = tl.program_id(0), tl.program_id(1)      # one program per (sequence, query head)\n'
               '    ...                                             # walk the pages with an online softmax\n\n'
               + DECODE_STUB.replace('def paged_decode(', 'def paged_decode_triton(').replace(
                   "read through its block table.", "with the Triton kernel."))

register(Puzzle("paged_attention_triton", "The online-softmax paged decode kernel in Triton", "04_paged_attention",
    "Puzzle 10 as a Triton kernel: one program per (sequence, query head) walks the sequence's pages one block at "
    "a time, loading only positions `< seq_len` (masked loads), and keeps a running max `m`, a running sum `l` and an "
    "accumulator `acc` rescaled by `exp(m_old - m_new)` at every page (the online softmax of FlashAttention), so it "
    "never holds all scores at once. `D` and `block_size` are powers of two here.",
    KERNEL_STUB, spec=_attention_spec, same=_same_tensor, n=3, run=_kernel_run))

def _ngram_case(rng):
    "A short token history over a small vocabulary (so n-grams repeat), and the proposer's knobs."
    hi = rng.randint(1, 4)
    return dict(token_ids=[rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(1, 30))], k=rng.randint(1, 6),
                max_n=hi, min_n=rng.randint(1, hi))

register(Puzzle("ngram_propose", "N-gram proposal (prompt lookup)", "07_speculative",
    "Propose up to `k` draft tokens with no draft model: find the last `n` tokens earlier in `token_ids` and "
    "propose the tokens that followed that occurrence. Try `n` from `max_n` down to `min_n` (the longest match "
    "wins); among occurrences of one `n`, the latest one; the suffix itself does not count. Return `[]` if none.",
    'def ngram_propose(token_ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:\n'
    '    "Up to k tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."\n'
    '    raise NotImplementedError',
    spec=ngram_propose, cases=_ngram_case,
    edge_cases=[dict(token_ids=[1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], k=3, max_n=3, min_n=1),
                dict(token_ids=[4, 5, 6, 5, 6], k=2, max_n=2, min_n=1), dict(token_ids=[1, 2, 3], k=4, max_n=2, min_n=1),
                dict(token_ids=[7], k=4, max_n=4, min_n=1), dict(token_ids=[1, 1, 1, 1], k=5, max_n=2, min_n=1)]))

assert check("ngram_propose", ngram_propose)

def _greedy_case(rng):
    "Drafts that agree with the target's argmax tokens for a while, then (often) do not."
    m = rng.randint(0, 6)
    target = [rng.randrange(4) for _ in range(m + 1)]
    cut = rng.randint(0, m)
    return dict(target_tokens=target, drafts=target[:cut] + [rng.randrange(4) for _ in range(m - cut)])

def _greedy_engine(fn):
    "The answer as the speculative decoder's greedy rule for one `generate`: tokens must equal Hugging Face's."
    saved, spec_decode.greedy_accept = spec_decode.greedy_accept, lambda target_tokens, drafts: _plain(fn(target_tokens, drafts))
    try:
        llm = engine_matches_hf(ENGINE_PROMPTS, max_tokens=12,
                                speculative_config=dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2))
    finally: spec_decode.greedy_accept = saved
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0, "engine check: no drafts were proposed, so nothing was verified"

register(Puzzle("greedy_accept", "Greedy acceptance", "07_speculative",
    "The target model scored the `m` drafts in one forward: `target_tokens[j]` is its greedy token after draft "
    "`j-1` (`m + 1` of them). Keep the drafts while each equals the target's token, stop at the first that does "
    "not, and add the target's own token at that position (if all match, its token after the last draft). The "
    "output is what greedy decoding would have produced, one to `m + 1` tokens.",
    'def greedy_accept(target_tokens: list[int], drafts: list[int]) -> list[int]:\n'
    '    "The matching prefix of drafts, then the target\'s own next token."\n'
    '    raise NotImplementedError',
    spec=greedy_accept, cases=_greedy_case, engine=_greedy_engine,
    edge_cases=[dict(target_tokens=[5, 6, 7, 8], drafts=[5, 6, 7]), dict(target_tokens=[5, 6, 7, 8], drafts=[5, 9, 7]),
                dict(target_tokens=[5, 6, 7, 8], drafts=[1, 6, 7]), dict(target_tokens=[3], drafts=[])]))

assert check("greedy_accept", greedy_accept)

P_TARGET = torch.tensor([[0.45, 0.25, 0.15, 0.10, 0.05], [0.05, 0.10, 0.15, 0.25, 0.45]])
Q_DRAFT = torch.tensor([[0.10, 0.10, 0.20, 0.20, 0.40], [0.30, 0.30, 0.20, 0.10, 0.10]])

def _rejection_case(rng):
    "Random target and draft distributions over 5 tokens, drafts drawn from the draft's."
    m = rng.randint(1, 3)
    g = torch.Generator().manual_seed(rng.randrange(10**6))
    p, q = torch.rand(m + 1, 5, generator=g).softmax(-1), torch.rand(m, 5, generator=g).softmax(-1)
    return p, q, [int(torch.multinomial(q[j], 1, generator=g)) for j in range(m)], g

def _rejection_structure(p, fn, n, seed):
    "Each output is drafts[:a] + [one token], 1 to m+1 long; with p == q every draft is accepted."
    for i in range(n):
        pt, q, d, g = _rejection_case(random.Random(seed*1_000_003 + i))
        if i % 4 == 0: pt = torch.cat([q, pt[-1:]])
        case = dict(p=pt, drafts=d, q=q)
        try: got = _plain(fn(pt, list(d), q.clone(), generator=g))
        except NotImplementedError as e: raise NotSolved(f"puzzle {p.name!r}: the answer raised NotImplementedError") from e
        ok = isinstance(got, list) and 1 <= len(got) <= len(d) + 1 and got[:-1] == d[:len(got) - 1]
        if not ok: _fail(p, f"random case {i} (seed={seed})", case, f"drafts[:a] + [token], 1 to {len(d) + 1} tokens", _show(got))
        if i % 4 == 0 and len(got) != len(d) + 1:
            _fail(p, f"random case {i} (seed={seed})", case, f"all {len(d)} drafts accepted (p == q), then a token", _show(got))

def _rejection_run(p, fn, n, seed, draws=3000):
    "Structure on `n` random cases, then the first emitted token's distribution, twice, by chi-square."
    _rejection_structure(p, fn, n, seed)
    for j, (pt, q) in enumerate([(P_TARGET, Q_DRAFT[0]), (P_TARGET.flip(0), Q_DRAFT[1])]):
        counts = first_token_histogram(pt, q, n=draws, seed=seed + j, sampler=fn)
        stat, pval = chi_square(counts, pt[0])
        if pval < 1e-3:
            _fail(p, f"distribution test {j} ({draws} draws, seed={seed + j})", dict(p=pt, q=q[None]),
                  f"first tokens distributed as p[0] = {[round(x, 3) for x in pt[0].tolist()]}",
                  f"frequencies {[round(x, 3) for x in (counts/counts.sum()).tolist()]} (chi-square {stat:.1f}, p-value {pval:.2g})")

register(Puzzle("rejection_sample", "Rejection sampling of drafts", "07_speculative",
    "The drafts were sampled from the draft model's `q[j]`; `p[j]` is the target's distribution at the same place "
    "(`m + 1` rows, `m` rows of `q`). Accept draft `j` with probability `min(1, p[j][d] / q[j][d])` (one "
    "`torch.rand(..., generator=generator)` draw each); at the first rejection, sample a token from the residual "
    "`max(0, p[j] - q[j])`, normalised, and stop; if all are accepted, sample one more from `p[m]`. Use "
    "`generator` for every draw. The emitted tokens are then distributed exactly as the target alone would sample them.",
    'def rejection_sample(p: "[m+1, V]", drafts: list[int], q: "[m, V]", generator: torch.Generator = None) -> list[int]:\n'
    '    "Accepted drafts, then one token from the residual (or from p[m]); distributed as the target samples."\n'
    '    raise NotImplementedError',
    spec=rejection_accept, n=40, run=_rejection_run))

assert check("rejection_sample", rejection_accept)
always = lambda p, drafts, q, generator=None: list(drafts) + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]
test_fail(lambda: check("rejection_sample", always), contains="distribution test 0")

def puzzles_table() -> str:
    "A markdown table of the puzzles, in teaching order."
    rows = [f"| {i} | `{p.name}` | {p.title} | `{p.lesson}` | {'yes' if p.engine else ''} |"
            for i, p in enumerate(PUZZLES.values(), 1)]
    return "\n".join(["| # | name | puzzle | lesson | engine check |", "|---|---|---|---|---|"] + rows)

assert len(PUZZLES) >= 12 and "`slot_mapping`" in puzzles_table()
