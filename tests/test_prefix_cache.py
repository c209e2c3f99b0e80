"""Tests for the prefix cache: stable hashing, lookup against a brute-force model, statistics, LRU eviction,
same-step duplicates, tenant isolation and bad input. (The random interleavings of every operation with prefix
caching on run in tests/test_block_manager.py::TestPrefixCachingBlockManagerMachine.)"""
import os, subprocess, sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagednb.block_manager import BlockManager, InvalidBlockError, NoFreeBlocksError, Sequence
from pagednb.prefix_cache import (PrefixCachingBlockManager, compute_block_hashes, hash_block, make_block_manager,
                                  replay_requests)

from helpers import prefill


# --- hashing ---

def test_hash_is_stable_across_processes():
    code = "from pagednb.prefix_cache import hash_block; print(hash_block(hash_block(None, range(16)), [5]*16, ('s',)).hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("0", "123")}
    assert outs == {hash_block(hash_block(None, range(16)), [5] * 16, ("s",)).hex()}


@given(st.lists(st.tuples(st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
                          st.lists(st.integers(0, 2**40), max_size=6).map(tuple), st.sampled_from([None, ("a",), ("b",), (1,)])),
                min_size=2, max_size=20, unique=True))
def test_hash_distinguishes_parent_tokens_and_keys(items):
    norm = {(p, t, k) for p, t, k in items}
    hashes = {hash_block(p, t, k) for p, t, k in norm}
    assert len(hashes) == len(norm)


def test_hash_rejects_unstable_extra_keys():
    with pytest.raises(TypeError, match="extra_keys"): hash_block(None, [1], (object(),))


def test_block_hashes_are_a_chain_and_cached_on_the_sequence():
    s = Sequence(0, range(40), cache_salt="x")
    hs = compute_block_hashes(s, 8, 5)
    assert hs[0] == hash_block(None, range(8), ("x",))
    assert all(hs[i] == hash_block(hs[i - 1], range(8 * i, 8 * i + 8)) for i in range(1, 5))
    assert compute_block_hashes(s, 8, 2) is s.block_hashes and len(s.block_hashes) == 5


# --- lookup against a brute-force model ---

@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(bs=st.sampled_from([1, 2, 4]),
       cached=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.sampled_from([None, "t"])), max_size=6),
       query=st.lists(st.integers(0, 2), min_size=1, max_size=14), salt=st.sampled_from([None, "t"]))
def test_lookup_is_longest_cached_prefix_capped(bs, cached, query, salt):
    bm = PrefixCachingBlockManager(256, block_size=bs, watermark=0)      # big enough: no eviction
    known = set()                                                       # (salt, token prefix) of every registered block
    for i, (toks, sl) in enumerate(cached):
        s = Sequence(i, toks, cache_salt=sl); prefill(bm, s)
        known |= {(sl, tuple(toks[:k * bs])) for k in range(1, len(toks) // bs + 1)}
        if i % 2: bm.deallocate(s)                                      # freed blocks stay cached
    q = Sequence(99, query, cache_salt=salt)
    hit = bm.get_computed_blocks(q)
    k = 0
    while (k + 1) * bs <= len(query) - 1 and (salt, tuple(query[:(k + 1) * bs])) in known: k += 1
    assert len(hit) == k
    bm.check_invariants()


def test_stats_count_once_per_admission():
    bm = make_block_manager(6, block_size=4, watermark=0)
    a = Sequence(0, range(12)); prefill(bm, a)                          # 12 queried, 0 hits
    big = Sequence(1, range(100, 130)); bm.allocate(big, 8)             # fill the pool (8 tokens: 2 blocks)
    b = Sequence(2, list(range(8)) + [50, 51, 52, 53, 54])
    for _ in range(3):                                                  # the scheduler retries: lookups are free
        hit = bm.get_computed_blocks(b)
        assert hit == a.block_table[:2] and not bm.can_allocate(b, 5, hit)
    st0 = bm.prefix_cache_stats
    assert (st0.queries, st0.hits) == (12 + 30, 0)
    bm.deallocate(big)
    bm.allocate(b, 5, hit)
    st1 = bm.prefix_cache_stats
    assert (st1.queries, st1.hits, st1.hit_rate) == (42 + 13, 8, pytest.approx(8 / 55))
    bm.allocate(b, 1)                                                   # later steps of a running sequence: not queries
    assert bm.prefix_cache_stats.queries == 55


# --- eviction ---

def test_lru_eviction_tail_first_and_forgets_hash():
    bm = make_block_manager(6, block_size=2, watermark=0)
    a = Sequence(0, range(7)); prefill(bm, a)                           # blocks 0,1,2 full+registered, 3 partial
    table = list(a.block_table)
    bm.deallocate(a)
    assert list(bm.cached_free) == table[2::-1] and bm.block_state(table[3]) == "free"
    # 3 plain free blocks (4, 5 and a's partial one) go first, then the tail of a
    x = Sequence(1, range(100, 108)); bm.allocate(x, 8)
    assert bm.prefix_cache_stats.evictions == 1 and table[2] in x.block_table and bm.blocks[table[2]].block_hash is None
    assert bm.get_computed_blocks(Sequence(2, range(7))) == table[:2]   # the head of a is still cached
    bm.check_invariants()


def test_hit_revives_cached_block_and_refcount_shares():
    bm = make_block_manager(8, block_size=4, watermark=0)
    a = Sequence(0, range(9)); prefill(bm, a); bm.deallocate(a)
    b, c = Sequence(1, range(10)), Sequence(2, range(11))
    assert prefill(bm, b) == [0, 1] and prefill(bm, c) == [0, 1]
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [2, 2] and not bm.cached_free.keys() & {0, 1}
    assert b.num_cached_tokens == c.num_cached_tokens == 8
    bm.check_invariants()


def test_reset_prefix_cache():
    bm = make_block_manager(8, block_size=4, watermark=0)
    a = Sequence(0, range(9)); prefill(bm, a); bm.deallocate(a)
    assert bm.reset_prefix_cache() == 2 and not bm.hash_to_block and bm.num_free_blocks == 8
    assert bm.get_computed_blocks(Sequence(1, range(9))) == []
    bm.check_invariants([])


# --- duplicates, salts, trims ---

def test_same_new_prefix_in_same_step_registers_once():
    bm = make_block_manager(16, block_size=4, watermark=0)
    twins = [Sequence(i, range(13)) for i in range(3)]
    for s in twins: bm.allocate(s, 13, bm.get_computed_blocks(s))
    for s in twins: s.num_computed_tokens = 13; bm.cache_blocks(s, 13)
    assert len(bm.hash_to_block) == 3
    assert [bm.hash_to_block[h] for h in twins[0].block_hashes] == twins[0].block_table[:3]
    for s in twins[1:]: assert all(bm.blocks[b].block_hash is None for b in s.block_table)
    bm.check_invariants()
    first = twins[0].block_table[:3]
    for s in reversed(twins): bm.deallocate(s)
    assert sorted(bm.cached_free) == sorted(first)                      # the copies of the others were never registered
    bm.check_invariants([])


def test_cache_salt_isolates_tenants():
    bm = make_block_manager(16, block_size=4, watermark=0)
    prefill(bm, Sequence(0, range(12), cache_salt="a"))
    assert bm.get_computed_blocks(Sequence(1, range(12), cache_salt="b")) == []
    assert bm.get_computed_blocks(Sequence(2, range(12))) == []
    assert len(bm.get_computed_blocks(Sequence(3, range(12), cache_salt="a"))) == 2


def test_trim_unregisters_a_block_left_partly_filled():
    bm = make_block_manager(8, block_size=4, watermark=0)
    a = Sequence(0, range(9)); prefill(bm, a)                           # blocks 0, 1 registered
    bm.trim(a, 6); del a.token_ids[6:]
    assert a.block_table == [0, 1] and bm.blocks[1].block_hash is None and len(a.block_hashes) == 1
    assert bm.get_computed_blocks(Sequence(1, range(9))) == [0]
    bm.check_invariants()


def test_trim_of_a_shared_registered_block_copies_on_write():
    bm = make_block_manager(8, block_size=4, watermark=0)
    a = Sequence(0, range(9)); prefill(bm, a)
    b = Sequence(1, range(9)); prefill(bm, b)                           # shares blocks 0, 1
    bm.trim(b, 6); del b.token_ids[6:]; b.token_ids.append(77)
    assert bm.blocks[1].block_hash is not None                          # a still holds it intact
    alloc = bm.allocate(b, 1)
    assert alloc.copies == [(1, alloc.new_blocks[0])] and b.block_table[1] != 1
    bm.check_invariants()


def test_trimmed_into_registered_block_copies_even_when_the_sharer_is_gone():
    "Found by the state machine: b trims into a block a still shares; a finishes; b's next write must not change the cached K/V."
    bm = make_block_manager(8, block_size=4, watermark=0)
    a = Sequence(0, range(9)); prefill(bm, a)
    b = Sequence(1, range(9)); prefill(bm, b)                           # shares blocks 0, 1
    bm.trim(b, 6); del b.token_ids[6:]; b.token_ids.append(77)
    bm.deallocate(a)                                                    # block 1 is b's alone now, and still registered
    assert bm.blocks[1].ref_count == 1 and bm.blocks[1].block_hash is not None
    alloc = bm.allocate(b, 1)
    assert alloc.copies == [(1, alloc.new_blocks[0])] and b.block_table[1] != 1
    assert bm.get_computed_blocks(Sequence(2, range(9))) == [0, 1]      # the cached prefix is intact
    bm.check_invariants()


# --- bad input ---

def test_stale_hit_is_refused_and_changes_nothing():
    bm = make_block_manager(4, block_size=4, watermark=0)
    x = Sequence(0, range(9)); prefill(bm, x); bm.deallocate(x)
    y = Sequence(1, range(9)); hit = bm.get_computed_blocks(y)
    bm.allocate(Sequence(2, range(50, 66)), 16)                         # evicts both cached blocks
    before = (bm.ref_counts, list(bm.free_block_ids), dict(bm.hash_to_block))
    with pytest.raises(InvalidBlockError, match="evicted since the lookup"): bm.allocate(y, 1, hit)
    with pytest.raises(InvalidBlockError, match=r"0\.\.3"): bm.allocate(y, 1, [7])
    assert (bm.ref_counts, list(bm.free_block_ids), dict(bm.hash_to_block)) == before and 1 not in bm.seqs


def test_refused_admission_with_hit_changes_nothing():
    bm = make_block_manager(4, block_size=4, watermark=0)
    a = Sequence(0, range(9)); prefill(bm, a); bm.deallocate(a)         # 2 cached-free blocks
    b = Sequence(1, list(range(8)) + list(range(100, 120)))
    hit = bm.get_computed_blocks(b)
    before = (bm.ref_counts, list(bm.free_block_ids), list(bm.cached_free), bm.prefix_cache_stats)
    with pytest.raises(NoFreeBlocksError, match="needs 7 free blocks but only 4"): bm.allocate(b, 20, hit)
    assert (bm.ref_counts, list(bm.free_block_ids), list(bm.cached_free), bm.prefix_cache_stats) == before


def test_make_block_manager():
    assert type(make_block_manager(4, enable_prefix_caching=False)) is BlockManager
    bm = make_block_manager(4, block_size=8)
    assert isinstance(bm, PrefixCachingBlockManager) and bm.block_size == 8 and bm.enable_prefix_caching
    with pytest.raises(ValueError, match="power of two"): make_block_manager(4, block_size=24)


# --- a small serving replay ---

def test_replay_shared_system_prompt():
    import random
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(64)]
    prompts = [system + [rng.randrange(1000) for _ in range(rng.randint(5, 40))] for _ in range(40)]
    res = {}
    for caching in (False, True):
        bm = make_block_manager(128, block_size=16, enable_prefix_caching=caching)
        res[caching] = replay_requests(bm, prompts, output_len=8, max_num_seqs=8)
        assert bm.num_used_blocks == 0 and bm.check_invariants([])
    assert res[True]["stats"].hit_rate > 0.5
    assert res[True]["prefill_tokens"] < res[False]["prefill_tokens"] / 2
    assert res[True]["peak_used_blocks"] < res[False]["peak_used_blocks"]


def test_replay_preempts_when_the_pool_runs_out():
    prompts = [list(range(100*i, 100*i + 14)) for i in range(6)]        # 3 fit at admission, not once they grow
    bm = make_block_manager(12, block_size=4, watermark=0)
    res = replay_requests(bm, prompts, output_len=10, max_num_seqs=6)
    assert res["preemptions"] > 0 and bm.num_used_blocks == 0
    bm.check_invariants([])


# --- KV-cache groups: a full group and a window group over one pool ---

def _run_through(bm, seq):
    "Admit `seq`, compute all its tokens, let the window give blocks back, register; then free it."
    bm.allocate(seq, seq.num_tokens, bm.get_computed_blocks(seq))
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq, seq.num_tokens)
    bm.free_skipped(seq)
    bm.deallocate(seq)

def test_hybrid_hit_worked_by_hand():
    "A full group serves the cached prefix from block 0; a window of 6 only needs the 2 blocks before the hit."
    bm = PrefixCachingBlockManager(40, 4, watermark=0.0, windows=(None, 6))
    a = Sequence(0, list(range(100, 124)))                   # 24 tokens, 6 full blocks
    _run_through(bm, a)
    b = Sequence(1, list(range(100, 120)) + [7]*8)          # shares blocks 0..4 (20 tokens), 28 tokens
    hit = bm.get_computed_blocks(b)
    assert len(hit) == 5
    assert [h[1] for h in hit[:3]] == [bm.null_block]*3     # the window group needs blocks 3 and 4 only
    assert all(h[0] != bm.null_block for h in hit) and all(h[1] != bm.null_block for h in hit[3:])
    assert b.group_hit_tokens == [20, 20]

def test_hybrid_hit_is_the_shortest_group_and_counted_per_group():
    "The window gave its early blocks back first; a later request evicts them; the next hit is what all serve."
    bm = PrefixCachingBlockManager(41, 4, watermark=0.0, windows=(None, 6))    # 40 blocks and the null block
    _run_through(bm, Sequence(0, list(range(100, 124))))    # the window group's blocks 0..3 are freed first
    _run_through(bm, Sequence(1, list(range(300, 364))))    # 2 x 16 blocks: 28 free ones, then 4 evicted (LRU)
    b = Sequence(2, list(range(100, 120)) + [7]*8)
    hit = bm.get_computed_blocks(b)
    assert b.group_hit_tokens == [20, 0]                     # the full group alone could serve the document
    assert hit == []                                         # but a hybrid hit must be served by every group
    bm.allocate(b, b.num_tokens, hit)
    assert bm.prefix_cache_stats.hits_per_group == [20, 0] and bm.prefix_cache_stats.hits == 0
