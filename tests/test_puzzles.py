"The puzzles' checkers: every stub fails, every solution passes, and plausible wrong answers fail naming the case."
import json, re
from pathlib import Path
import pytest, torch
from pagednb.attention import triton, tl, HAS_TRITON
from pagednb.prefix_cache import hash_block
from pagednb.puzzles import PUZZLES, check, get_puzzle, try_check, NotSolved

NBS = Path(__file__).resolve().parent.parent/"nbs"
LEARNER = ["13_puzzles_memory.ipynb", "14_puzzles_scheduling.ipynb", "15_puzzles_kernels.ipynb"]

def fn_name(p): return re.findall(r"def (\w+)\(", p.stub)[-1]

def code_cells(name):
    return ["".join(c["source"]) for c in json.loads((NBS/name).read_text())["cells"] if c["cell_type"] == "code"]

def learner_stubs():
    "Every stub of the learner notebooks, as the learner first sees it: {puzzle: function}."
    out = {}
    for nb in LEARNER:
        for src in code_cells(nb):
            names = re.findall(r"^def (\w+)\(", src, re.M)
            for k, p in PUZZLES.items():
                if names and names[-1] == fn_name(p) and k not in out:
                    ns = dict(torch=torch)
                    exec(src, ns)
                    out[k] = ns[fn_name(p)]
    return out

def solutions():
    "Every solution of `16_puzzle_solutions`: {puzzle: function}."
    out = {}
    for src in code_cells("16_puzzle_solutions.ipynb"):
        m = re.match(r"# solution: (\w+)", src)
        if m:
            ns = {}
            exec(src, ns)
            out[m.group(1)] = ns[fn_name(PUZZLES[m.group(1)])]
    return out

STUBS, SOLUTIONS = learner_stubs(), solutions()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

def test_every_puzzle_has_a_stub_and_a_solution():
    assert len(PUZZLES) >= 12
    assert set(STUBS) == set(PUZZLES) == set(SOLUTIONS)

@pytest.mark.parametrize("name", list(PUZZLES))
def test_stub_fails(name, capsys):
    if name == "paged_attention_triton" and not HAS_TRITON: pytest.skip("Triton is not installed")
    with pytest.raises(NotSolved, match="NotImplementedError"): check(name, STUBS[name])
    assert try_check(name, STUBS[name]) is False and "not solved yet" in capsys.readouterr().out

@pytest.mark.parametrize("name", list(PUZZLES))
def test_solution_passes(name):
    if name == "paged_attention_triton" and not HAS_TRITON: pytest.skip("Triton is not installed")
    assert check(name, SOLUTIONS[name])

@pytest.mark.parametrize("name", [k for k, p in PUZZLES.items() if p.engine])
def test_solution_passes_in_the_engine(name):
    get_puzzle(name).engine(SOLUTIONS[name])

# ---- plausible wrong answers, three per puzzle
def kv_no_v(cfg, dtype_bytes):
    h = cfg["num_attention_heads"]
    return cfg["num_hidden_layers"]*cfg.get("num_key_value_heads", h)*(cfg.get("head_dim") or cfg["hidden_size"]//h)*dtype_bytes
def kv_query_heads(cfg, dtype_bytes):
    h = cfg["num_attention_heads"]
    return 2*cfg["num_hidden_layers"]*h*(cfg.get("head_dim") or cfg["hidden_size"]//h)*dtype_bytes
def kv_no_head_dim(cfg, dtype_bytes):
    h = cfg["num_attention_heads"]
    return 2*cfg["num_hidden_layers"]*cfg.get("num_key_value_heads", h)*(cfg["hidden_size"]//h)*dtype_bytes

def waste_prompt_only(workload, max_model_len): return 1 - sum(p for p, o in workload)/(len(workload)*max_model_len)
def waste_utilization(workload, max_model_len): return sum(p + o for p, o in workload)/(len(workload)*max_model_len)
def waste_no_check(workload, max_model_len): return 1 - sum(p + o for p, o in workload)/(len(workload)*max_model_len)

def slots_no_scale(block_table, positions, block_size): return [block_table[p//block_size] + p % block_size for p in positions]
def slots_off_by_one(block_table, positions, block_size):
    return [block_table[(p + 1)//block_size % len(block_table)]*block_size + (p + 1) % block_size for p in positions]
def slots_no_table(block_table, positions, block_size): return list(positions)

def _blocks(nc, new, bs): return -(-(nc + new)//bs)
def alloc_from_back(block_table, free_blocks, num_computed_tokens, num_new_tokens, block_size):
    need = max(0, _blocks(num_computed_tokens, num_new_tokens, block_size) - len(block_table))
    if need > len(free_blocks): raise MemoryError
    return block_table + free_blocks[::-1][:need], free_blocks[::-1][need:][::-1]
def alloc_over(block_table, free_blocks, num_computed_tokens, num_new_tokens, block_size):
    need = max(0, (num_computed_tokens + num_new_tokens)//block_size + 1 - len(block_table))
    if need > len(free_blocks): raise MemoryError
    return block_table + free_blocks[:need], free_blocks[need:]
def alloc_partial(block_table, free_blocks, num_computed_tokens, num_new_tokens, block_size):
    while len(block_table)*block_size < num_computed_tokens + num_new_tokens:
        if not free_blocks: raise MemoryError("out of blocks")
        block_table.append(free_blocks.pop(0))               # changes the caller's lists before it knows it fits
    return block_table, free_blocks

def _cow(block_table, ref_counts, free_blocks, nc, new, bs, decref=True, need_shared=True, swap=False):
    end = _blocks(nc, new, bs)
    written = range(nc//bs, min(len(block_table), end))
    shared = [i for i in written if ref_counts[block_table[i]] > 1 or not need_shared]
    append = max(0, end - len(block_table))
    if len(shared) + append > len(free_blocks): raise MemoryError
    table, refs, free, copies = list(block_table), list(ref_counts), list(free_blocks), []
    for i in shared:
        old, nw = table[i], free.pop(0)
        table[i], refs[nw] = nw, 1
        if decref: refs[old] -= 1
        if i*bs < nc: copies.append((nw, old) if swap else (old, nw))
    for _ in range(append):
        table.append(free.pop(0))
        refs[table[-1]] = 1
    return table, refs, free, copies
def cow_no_decref(block_table, ref_counts, free_blocks, num_computed_tokens, num_new_tokens, block_size):
    return _cow(block_table, ref_counts, free_blocks, num_computed_tokens, num_new_tokens, block_size, decref=False)
def cow_always(block_table, ref_counts, free_blocks, num_computed_tokens, num_new_tokens, block_size):
    return _cow(block_table, ref_counts, free_blocks, num_computed_tokens, num_new_tokens, block_size, need_shared=False)
def cow_swapped(block_table, ref_counts, free_blocks, num_computed_tokens, num_new_tokens, block_size):
    return _cow(block_table, ref_counts, free_blocks, num_computed_tokens, num_new_tokens, block_size, swap=True)

def hashes_no_parent(token_ids, block_size, cache_salt=None):
    n = len(token_ids)//block_size
    return [hash_block(None, token_ids[i*block_size:(i + 1)*block_size], (cache_salt,) if i == 0 and cache_salt else None)
            for i in range(n)]
def hashes_partial(token_ids, block_size, cache_salt=None):
    out, parent = [], None
    for i in range(-(-len(token_ids)//block_size)):
        parent = hash_block(parent, token_ids[i*block_size:(i + 1)*block_size], (cache_salt,) if i == 0 and cache_salt else None)
        out.append(parent)
    return out
def hashes_salt_everywhere(token_ids, block_size, cache_salt=None):
    out, parent = [], None
    for i in range(len(token_ids)//block_size):
        parent = hash_block(parent, token_ids[i*block_size:(i + 1)*block_size], (cache_salt,) if cache_salt else None)
        out.append(parent)
    return out

def _lookup(block_hashes, num_tokens, block_size, hash_to_block, free_blocks, cached_free, cap=True, mru=False, revive=True):
    hits = []
    for h in block_hashes[:(num_tokens - 1)//block_size if cap else None]:
        if h not in hash_to_block: break
        hits.append(hash_to_block[h])
    evictable = [b for b in cached_free if b not in hits or not revive]
    if mru: evictable = evictable[::-1]
    need = -(-num_tokens//block_size) - len(hits)
    if need > len(free_blocks) + len(evictable): raise MemoryError
    return hits, (free_blocks + evictable)[:need]
def lookup_no_cap(block_hashes, num_tokens, block_size, hash_to_block, free_blocks, cached_free):
    return _lookup(block_hashes, num_tokens, block_size, hash_to_block, free_blocks, cached_free, cap=False)
def lookup_mru(block_hashes, num_tokens, block_size, hash_to_block, free_blocks, cached_free):
    return _lookup(block_hashes, num_tokens, block_size, hash_to_block, free_blocks, cached_free, mru=True)
def lookup_evicts_hits(block_hashes, num_tokens, block_size, hash_to_block, free_blocks, cached_free):
    return _lookup(block_hashes, num_tokens, block_size, hash_to_block, free_blocks, cached_free, revive=False)

def _step(running, waiting, budget, max_num_seqs, decodes_first=True, chunk=True, seats=True):
    order = sorted(running, key=lambda r: r[1] - r[2] > 1) if decodes_first else running
    out = []
    for sid, nt, nc in order:
        if budget <= 0: break
        out.append((sid, min(nt - nc, budget)))
        budget -= out[-1][1]
    free_seats = max_num_seqs - len(running) if seats else len(waiting)
    for sid, nt in waiting:
        if budget <= 0 or free_seats <= 0 or (not chunk and nt > budget): break
        out.append((sid, min(nt, budget)))
        budget, free_seats = budget - out[-1][1], free_seats - 1
    return out
def step_prefill_first(running, waiting, max_num_batched_tokens, max_num_seqs):
    return _step(running, waiting, max_num_batched_tokens, max_num_seqs, decodes_first=False)
def step_no_chunking(running, waiting, max_num_batched_tokens, max_num_seqs):
    return _step(running, waiting, max_num_batched_tokens, max_num_seqs, chunk=False)
def step_no_seat_limit(running, waiting, max_num_batched_tokens, max_num_seqs):
    return _step(running, waiting, max_num_batched_tokens, max_num_seqs, seats=False)

def _preempt(running, free, bs, budget, oldest=False, cost_all=False, any_victim=False):
    held = {sid: -(-nc//bs) for sid, nt, nc in running}
    info = {r[0]: r for r in running}
    live, done, out, lost = [r[0] for r in running], set(), [], 0
    for sid, nt, nc in sorted(running, key=lambda r: r[1] - r[2] > 1):
        if budget <= 0: break
        if sid not in live: continue
        n = min(nt - nc, budget)
        need = _blocks(nc, n, bs) - held[sid]
        while need > free:
            others = [s for s in live if (any_victim or s not in done) and s != sid]
            victim = (others[0] if oldest else others[-1]) if others else sid
            live.remove(victim)
            free += held[victim]
            out.append(victim)
            lost += info[victim][1] if cost_all else info[victim][2]
            if victim == sid: break
        if sid not in live: continue
        free, held[sid], budget = free - need, held[sid] + need, budget - n
        done.add(sid)
    return out, lost
def preempt_oldest(running, num_free_blocks, block_size, max_num_batched_tokens):
    return _preempt(running, num_free_blocks, block_size, max_num_batched_tokens, oldest=True)
def preempt_cost_all_tokens(running, num_free_blocks, block_size, max_num_batched_tokens):
    return _preempt(running, num_free_blocks, block_size, max_num_batched_tokens, cost_all=True)
def preempt_scheduled_too(running, num_free_blocks, block_size, max_num_batched_tokens):
    return _preempt(running, num_free_blocks, block_size, max_num_batched_tokens, any_victim=True)

def _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, whole_blocks=False, modulo=False, unscaled=False):
    S, H, D = query.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    for s in range(S):
        L = int(seq_lens[s])
        pos = torch.arange(-(-L//bs)*bs if whole_blocks else L)
        slots = block_tables[s, pos//bs].long()*bs + pos % bs
        heads = torch.arange(H) % kvh if modulo else torch.arange(H)//(H//kvh)
        k = k_cache.reshape(-1, kvh, D)[slots][:, heads].float()
        v = v_cache.reshape(-1, kvh, D)[slots][:, heads].float()
        w = (torch.einsum("hd,lhd->hl", query[s].float(), k)*(1.0 if unscaled else scale)).softmax(-1)
        out[s] = torch.einsum("hl,lhd->hd", w, v).to(query.dtype)
    return out
def decode_whole_blocks(query, k_cache, v_cache, block_tables, seq_lens, scale):
    return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, whole_blocks=True)
def decode_head_modulo(query, k_cache, v_cache, block_tables, seq_lens, scale):
    return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, modulo=True)
def decode_unscaled(query, k_cache, v_cache, block_tables, seq_lens, scale):
    return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, unscaled=True)

@triton.jit
def _wrong_kernel(Q, K, V, O, BLOCK_TABLES, SEQ_LENS, scale, bt_stride, H: tl.constexpr, KVH: tl.constexpr,
                  D: tl.constexpr, BS: tl.constexpr, BUG: tl.constexpr):
    s, h = tl.program_id(0), tl.program_id(1)
    L = tl.load(SEQ_LENS + s)
    d, off = tl.arange(0, D), tl.arange(0, BS)
    q = tl.load(Q + (s*H + h)*D + d).to(tl.float32)
    kvh = h % KVH if BUG == 3 else h // (H // KVH)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for page in range(0, tl.cdiv(L, BS)):
        pos = page*BS + off
        ok = pos < (page + 1)*BS if BUG == 1 else pos < L             # 1: reads the whole last page, past seq_len
        blk = tl.load(BLOCK_TABLES + s*bt_stride + page).to(tl.int64)
        rows = ((blk*BS + off)*KVH + kvh)*D
        k = tl.load(K + rows[:, None] + d[None, :], mask=ok[:, None], other=0.).to(tl.float32)
        v = tl.load(V + rows[:, None] + d[None, :], mask=ok[:, None], other=0.).to(tl.float32)
        x = tl.where(ok, tl.sum(k*q[None, :], 1)*scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(x - m_new)
        l = l*alpha + tl.sum(p, 0)
        acc = acc + tl.sum(p[:, None]*v, 0) if BUG == 2 else acc*alpha + tl.sum(p[:, None]*v, 0)   # 2: no rescale
        m = m_new
    tl.store(O + (s*H + h)*D + d, (acc/l).to(O.dtype.element_ty))

def _triton_wrong(bug):
    def paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, scale):
        S, H, D = query.shape
        out = torch.empty_like(query)
        _wrong_kernel[(S, H)](query, k_cache, v_cache, out, block_tables, seq_lens, scale, block_tables.stride(0),
                              H=H, KVH=k_cache.shape[2], D=D, BS=k_cache.shape[1], BUG=bug)
        return out
    paged_decode_triton.__name__ = ["", "kernel_reads_past_seq_len", "kernel_without_rescale", "kernel_head_modulo"][bug]
    return paged_decode_triton

def ngram_earliest(token_ids, k, max_n=4, min_n=1):
    t = list(token_ids)
    for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
        for i in range(0, len(t) - n):
            if t[i:i + n] == t[-n:]: return t[i + n:i + n + k]
    return []
def ngram_shortest_first(token_ids, k, max_n=4, min_n=1):
    t = list(token_ids)
    for n in range(min_n, min(max_n, len(t) - 1) + 1):
        for i in range(len(t) - n - 1, -1, -1):
            if t[i:i + n] == t[-n:]: return t[i + n:i + n + k]
    return []
def ngram_matches_itself(token_ids, k, max_n=4, min_n=1):
    t = list(token_ids)
    for n in range(min(max_n, len(t)), min_n - 1, -1):
        for i in range(len(t) - n, -1, -1):
            if t[i:i + n] == t[-n:]: return t[i + n:i + n + k]
    return []

def greedy_keeps_mismatch(target_tokens, drafts):
    a = 0
    while a < len(drafts) and drafts[a] == target_tokens[a]: a += 1
    return list(drafts[:a + 1]) + ([target_tokens[a + 1]] if a < len(drafts) else [target_tokens[a]])
def greedy_no_bonus(target_tokens, drafts):
    a = 0
    while a < len(drafts) and drafts[a] == target_tokens[a]: a += 1
    return list(drafts[:a]) + ([target_tokens[a]] if a < len(drafts) else [])
def greedy_shifted(target_tokens, drafts):
    a = 0
    while a < len(drafts) and drafts[a] == target_tokens[min(a + 1, len(drafts))]: a += 1
    return list(drafts[:a]) + [target_tokens[a]]

def _reject(p, drafts, q, generator, accept=None, residual=True):
    for j, d in enumerate(drafts):
        ratio = 1.0 if accept == "always" else (q[j, d]/p[j, d] if accept == "inverse" else p[j, d]/q[j, d]).item()
        if torch.rand(1, generator=generator).item() >= min(1.0, ratio):
            r = (p[j] - q[j]).clamp_min(0) if residual else p[j]
            if r.sum() <= 0: r = p[j]
            return list(drafts[:j]) + [int(torch.multinomial(r/r.sum(), 1, generator=generator))]
    return list(drafts) + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]
def reject_always_accept(p, drafts, q, generator=None): return _reject(p, drafts, q, generator, accept="always")
def reject_resample_from_p(p, drafts, q, generator=None): return _reject(p, drafts, q, generator, residual=False)
def reject_inverse_ratio(p, drafts, q, generator=None): return _reject(p, drafts, q, generator, accept="inverse")

def _window_free(block_table, nc, window, bs, passed):
    table, freed = list(block_table), []
    for i in range(min(passed, len(table))):
        if table[i] != 0: freed.append(table[i])
        table[i] = 0
    return table, freed
def window_off_by_one(block_table, num_computed_tokens, window, block_size):
    return _window_free(block_table, num_computed_tokens, window, block_size, max(0, num_computed_tokens - window)//block_size)
def window_partial_blocks(block_table, num_computed_tokens, window, block_size):
    return _window_free(block_table, num_computed_tokens, window, block_size, -(-max(0, num_computed_tokens - window + 1)//block_size))
def window_frees_nulls(block_table, num_computed_tokens, window, block_size):
    passed = max(0, num_computed_tokens - window + 1)//block_size
    return [0]*min(passed, len(block_table)) + list(block_table[passed:]), list(block_table[:passed])

def _tier(block_hashes, num_tokens, block_size, pool, tier, room, cap=None, touch_all=True):
    cap = (num_tokens - 1)//block_size if cap is None else cap
    hits = []
    for h in block_hashes[:cap]:
        if h not in pool: break
        hits.append(pool[h])
    run = []
    for h in block_hashes[len(hits):cap]:
        if h not in tier: break
        run.append(h)
    moved = run if touch_all else run[:max(0, room)]
    return hits, run[:max(0, room)], [h for h in tier if h not in moved] + moved
def tier_no_cap(block_hashes, num_tokens, block_size, pool, tier, room):
    return _tier(block_hashes, num_tokens, block_size, pool, tier, room, cap=num_tokens//block_size)
def tier_ignores_room(block_hashes, num_tokens, block_size, pool, tier, room):
    return _tier(block_hashes, num_tokens, block_size, pool, tier, len(block_hashes))
def tier_touches_loaded_only(block_hashes, num_tokens, block_size, pool, tier, room):
    return _tier(block_hashes, num_tokens, block_size, pool, tier, room, touch_all=False)

# quantised_attention: no saturation, the scale applied the wrong way round, V's scale forgotten
_FMT = dict(bfloat16=torch.bfloat16, float16=torch.float16, fp8_e4m3=torch.float8_e4m3fn, fp8_e5m2=torch.float8_e5m2)

def _quantised_attend(query, k, v, scale):
    G = query.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    return torch.einsum("hn,nhd->hd", (torch.einsum("hd,nhd->hn", query, k) * scale).softmax(-1), v)

def quantised_no_saturation(query, k_page, v_page, kv_cache_dtype, k_scale, v_scale, scale):
    dt = _FMT[kv_cache_dtype]
    return _quantised_attend(query, (k_page / k_scale).to(dt).float() * k_scale, (v_page / v_scale).to(dt).float() * v_scale, scale)

def quantised_scale_inverted(query, k_page, v_page, kv_cache_dtype, k_scale, v_scale, scale):
    dt = _FMT[kv_cache_dtype]
    big = torch.finfo(dt).max
    read = lambda x, s: (x * s).clamp(-big, big).to(dt).float() / s
    return _quantised_attend(query, read(k_page, k_scale), read(v_page, v_scale), scale)

def quantised_no_v_scale(query, k_page, v_page, kv_cache_dtype, k_scale, v_scale, scale):
    dt = _FMT[kv_cache_dtype]
    big = torch.finfo(dt).max
    read = lambda x, s: (x / s).clamp(-big, big).to(dt).float()
    return _quantised_attend(query, read(k_page, k_scale) * k_scale, read(v_page, v_scale), scale)

WRONG = {
    "kv_bytes_per_token": [kv_no_v, kv_query_heads, kv_no_head_dim],
    "contiguous_waste": [waste_prompt_only, waste_utilization, waste_no_check],
    "slot_mapping": [slots_no_scale, slots_off_by_one, slots_no_table],
    "allocate": [alloc_from_back, alloc_over, alloc_partial],
    "copy_on_write": [cow_no_decref, cow_always, cow_swapped],
    "block_hashes": [hashes_no_parent, hashes_partial, hashes_salt_everywhere],
    "prefix_lookup": [lookup_no_cap, lookup_mru, lookup_evicts_hits],
    "window_free": [window_off_by_one, window_partial_blocks, window_frees_nulls],
    "tier_lookup": [tier_no_cap, tier_ignores_room, tier_touches_loaded_only],
    "schedule_step": [step_prefill_first, step_no_chunking, step_no_seat_limit],
    "preempt": [preempt_oldest, preempt_cost_all_tokens, preempt_scheduled_too],
    "paged_attention": [decode_whole_blocks, decode_head_modulo, decode_unscaled],
    "paged_attention_triton": [_triton_wrong(1), _triton_wrong(2), _triton_wrong(3)],
    "ngram_propose": [ngram_earliest, ngram_shortest_first, ngram_matches_itself],
    "greedy_accept": [greedy_keeps_mismatch, greedy_no_bonus, greedy_shifted],
    "rejection_sample": [reject_always_accept, reject_resample_from_p, reject_inverse_ratio],
    "quantised_attention": [quantised_no_saturation, quantised_scale_inverted, quantised_no_v_scale],
}

def test_three_wrong_answers_per_puzzle(): assert set(WRONG) == set(PUZZLES) and all(len(v) == 3 for v in WRONG.values())

@pytest.mark.parametrize("name,fn", [(k, f) for k, fs in WRONG.items() for f in fs], ids=lambda x: getattr(x, "__name__", x))
def test_wrong_answer_fails_naming_the_case(name, fn):
    if name == "paged_attention_triton" and not HAS_TRITON: pytest.skip("Triton is not installed")
    with pytest.raises(AssertionError) as e: check(name, fn)
    msg = str(e.value)
    assert not isinstance(e.value, NotSolved)
    assert re.search(r"failed on (edge case \d+|random case \d+ \(seed=0\)|distribution test \d)", msg), msg
    assert "inputs:" in msg and "expected:" in msg and "got:" in msg, msg

@pytest.mark.parametrize("name,fn", [("slot_mapping", slots_no_table), ("greedy_accept", greedy_keeps_mismatch)])
def test_wrong_answer_fails_in_the_engine(name, fn):
    "The engine alone, without the case loop, catches a wrong slot mapping and a wrong acceptance rule."
    with pytest.raises(AssertionError, match="engine check: prompt \\d"): get_puzzle(name).engine(fn)

def test_failure_message_names_inputs_expected_and_got():
    with pytest.raises(AssertionError) as e: check("slot_mapping", slots_no_scale)
    assert "edge case 0" in str(e.value) and "block_table = [7, 3]" in str(e.value) and "expected: [31, 12]" in str(e.value)

def test_unknown_puzzle_and_engine():
    with pytest.raises(KeyError, match="the puzzles are"): check("slots", SOLUTIONS["slot_mapping"])
    with pytest.raises(ValueError, match="has no engine check; these do"): check("allocate", SOLUTIONS["allocate"], engine=True)
