"""Property tests for the paged block manager (with and without prefix caching).

A hypothesis state machine interleaves admit (prefix lookup + allocate), compute steps (allocate with
lookahead, copy-on-write, cache_blocks, append), fork, free, trim and pure lookups on small pools, and
checks after every operation, independently of the manager's own bookkeeping:

- each block is used or free/cached-free, never both; ref counts equal the block tables holding them;
- no two blocks hold the same hash;
- every live sequence reads back exactly its own K/V: a model of the cache (slot -> prefix id) is written
  through `slot_mapping` and the copy-on-write copies, so wrong sharing, a missed copy or a stale prefix hit
  shows up as a wrong slot;
- a refused allocation leaves the pool unchanged; `can_allocate` true implies `allocate` succeeds;
- after freeing everything, every block is free or cached-free (no leaks).
"""
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagednb.block_manager import (BlockManager, InvalidBlockError, NoFreeBlocksError, Sequence, UnknownSequenceError,
                                   check_block_size, compute_slot_mapping)
from pagednb.prefix_cache import PrefixCachingBlockManager, make_block_manager

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3] * 12]
TOKENS = st.integers(0, 3)          # a tiny vocabulary, so sequences coincide and share blocks often


def state(bm):
    "Everything a refused allocation must leave unchanged."
    return ([(b.ref_count, b.block_hash) for b in bm.blocks], list(bm.free_block_ids), list(bm.cached_free),
            {i: list(s.block_table) for i, s in bm.seqs.items()}, {i: s.num_computed_tokens for i, s in bm.seqs.items()},
            getattr(bm, "hash_to_block", {}).copy(), bm.num_used_blocks)


def prefix_ids(seq):
    "Identity of the K/V of each position: depends on the token and everything before it."
    out, h = [], 0
    for t in seq.token_ids:
        h = hash((h, t)); out.append(h)
    return out


class PoolMachine(RuleBasedStateMachine):
    PREFIX = False

    @initialize(nb=st.integers(3, 40), bs=st.sampled_from([1, 2, 4, 8]), wm=st.sampled_from([0.0, 0.1]))
    def init(self, nb, bs, wm):
        self.bm = make_block_manager(nb, bs, enable_prefix_caching=self.PREFIX, watermark=wm)
        self.live, self.kv, self.next_id = {}, {}, 0

    # --- helpers ---
    STEPS = Counter()

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _state(self, bm): return state(bm)

    def _allocate(self, seq, n, hit=(), la=0):
        "allocate; on refusal check that nothing changed and that can_allocate agreed. Returns the Allocation or None."
        bm, can = self.bm, self.bm.can_allocate(seq, n, hit, la)
        before = self._state(bm)
        try: alloc = bm.allocate(seq, n, hit, la)
        except NoFreeBlocksError:
            assert not can, "can_allocate said yes but allocate refused"
            assert self._state(bm) == before, "a refused allocation changed the pool"
            event("allocation refused")
            return None
        if alloc.copies: event("copy-on-write copy")
        need = seq.num_computed_tokens + n + la
        assert all(len(t) * bm.block_size >= need for t in seq.block_tables)
        return alloc

    def _compute(self, seq, n, alloc, data):
        "What the runner and engine do: copy-on-write copies, write K/V at the slots, advance, register, sample."
        bm, bs = self.bm, self.bm.block_size
        for src, dst in alloc.copies:
            for o in range(bs): self.kv[dst * bs + o] = self.kv.get(src * bs + o)
        c, pids = seq.num_computed_tokens, prefix_ids(seq)
        for p, slot in zip(range(c, c + n), bm.slot_mapping(seq, c, c + n)): self.kv[slot] = (pids[p], seq.cache_salt)
        seq.num_computed_tokens += n
        bm.cache_blocks(seq, seq.num_computed_tokens)
        if seq.num_computed_tokens == seq.num_tokens: seq.token_ids.append(data.draw(TOKENS))

    def _pick(self, data):
        return self.live[data.draw(st.sampled_from(sorted(self.live)))]

    # --- rules ---
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), tail=st.lists(TOKENS, max_size=12), salt=st.sampled_from([None, None, "t"]))
    def admit(self, data, prefix, tail, salt):
        prompt = prefix + tail or [0]
        seq = Sequence(self._new_id(), prompt, cache_salt=salt)
        before = state(self.bm)
        hit = self.bm.get_computed_blocks(seq)
        assert state(self.bm) == before, "get_computed_blocks changed state"
        bs = self.bm.block_size
        assert len(hit) * bs < seq.num_tokens, "the lookup must leave at least one token to compute"
        n = data.draw(st.integers(1, seq.num_tokens - len(hit) * bs))
        alloc = self._allocate(seq, n, hit, data.draw(st.integers(0, 2)))
        if alloc is None: return
        assert seq.num_cached_tokens == len(hit) * bs and seq.num_computed_tokens == len(hit) * bs
        if hit: event("prefix hit")
        self.live[seq.seq_id] = seq
        self._compute(seq, n, alloc, data)

    @rule(data=st.data())
    def step(self, data):
        if not self.live: return
        seq = self._pick(data)
        n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens))
        alloc = self._allocate(seq, n, (), data.draw(st.integers(0, 2)))
        if alloc is not None: self._compute(seq, n, alloc, data)

    @rule(data=st.data())
    def fork(self, data):
        if not self.live: return
        parent = self._pick(data)
        child = Sequence(self._new_id(), parent.token_ids, cache_salt=parent.cache_salt)
        self.bm.fork(parent, child)
        assert child.block_table == parent.block_table and child.num_computed_tokens == parent.num_computed_tokens
        if child.num_tokens > child.num_computed_tokens: child.token_ids[-1] = data.draw(TOKENS)   # a different sample
        self.live[child.seq_id] = child

    @rule(data=st.data())
    def free(self, data):
        if not self.live: return
        seq = self._pick(data)
        self.bm.deallocate(seq)
        del self.live[seq.seq_id]
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        with pytest.raises(UnknownSequenceError): self.bm.deallocate(seq)

    @rule(data=st.data())
    def trim(self, data):
        ids = sorted(i for i, s in self.live.items() if s.num_computed_tokens)
        if not ids: return
        seq = self.live[data.draw(st.sampled_from(ids))]
        k = data.draw(st.integers(1, seq.num_computed_tokens))
        self.bm.trim(seq, k)
        assert len(seq.block_table) == -(-k // self.bm.block_size) and seq.num_computed_tokens == k
        del seq.token_ids[k:]
        seq.token_ids.append(data.draw(TOKENS))      # the verifier's corrected token

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(TOKENS, max_size=8), salt=st.sampled_from([None, "t"]))
    def lookup(self, prefix, tail, salt):
        seq = Sequence(-1, prefix + tail or [0], cache_salt=salt)
        before = state(self.bm)
        hit = self.bm.get_computed_blocks(seq)
        assert state(self.bm) == before
        if self.PREFIX:
            for i, b in enumerate(hit): assert self.bm.hash_to_block[seq.block_hashes[i]] == b
        else: assert hit == []

    # --- invariants ---
    @invariant()
    def consistent(self):
        bm = getattr(self, "bm", None)
        if bm is None: return
        PoolMachine.STEPS[type(self).__name__] += 1
        live = list(self.live.values())
        bm.check_invariants(live)
        counts = Counter(b for s in live for b in s.block_table)
        for b in bm.blocks:
            assert b.ref_count == counts[b.block_id]
            assert (bm.block_state(b.block_id) == "used") == (counts[b.block_id] > 0)
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
        hashes = [b.block_hash for b in bm.blocks if b.block_hash is not None]
        assert len(hashes) == len(set(hashes)), "two blocks hold the same hash"
        bs = bm.block_size
        for s in live:       # every sequence reads back its own K/V (and its own tenant's)
            pids, n = prefix_ids(s), s.num_computed_tokens
            slots = bm.slot_mapping(s, 0, n)
            assert slots == [s.block_table[p // bs] * bs + p % bs for p in range(n)]
            for p, slot in enumerate(slots):
                assert self.kv.get(slot) == (pids[p], s.cache_salt), f"seq {s.seq_id} position {p} reads foreign K/V"

    def teardown(self):
        bm = getattr(self, "bm", None)
        if bm is None: return
        for s in list(self.live.values()): bm.deallocate(s)
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
        assert all(bm.block_state(i) in ("free", "cached") for i in range(bm.num_blocks))
        bm.check_invariants([])


class PrefixPoolMachine(PoolMachine):
    PREFIX = True


SETTINGS = settings(max_examples=150, stateful_step_count=80, deadline=None, suppress_health_check=list(HealthCheck))
TestBlockManagerMachine = PoolMachine.TestCase
TestBlockManagerMachine.settings = SETTINGS
TestPrefixCachingBlockManagerMachine = PrefixPoolMachine.TestCase
TestPrefixCachingBlockManagerMachine.settings = SETTINGS


# --- KV-cache groups: a block table per group over one pool, windows that free blocks as they pass ---

WINDOWS = [(None, 3), (5, None), (2, 9, None), (4,)]


def group_state(bm):
    "Every group's tables and registries too: what a refused allocation must leave unchanged."
    tables = {i: [list(t) for t in s.block_tables] for i, s in bm.seqs.items()}
    regs = [dict(r) for r in getattr(bm, "registries", [])]
    return state(bm), tables, regs


class HybridPoolMachine(PoolMachine):
    "The same rules on a manager with several KV-cache groups; after each compute, windows give blocks back."
    PREFIX = False

    @initialize(nb=st.integers(4, 40), bs=st.sampled_from([1, 2, 4]), windows=st.sampled_from(WINDOWS))
    def init(self, nb, bs, windows):
        self.bm = make_block_manager(nb, bs, enable_prefix_caching=self.PREFIX, watermark=0.0, windows=windows)
        self.live, self.kv, self.next_id = {}, {}, 0

    def _state(self, bm): return group_state(bm)

    def _compute(self, seq, n, alloc, data):
        "Write K/V at every group's slots, advance, register, give back what left each window."
        bm, bs = self.bm, self.bm.block_size
        for src, dst in alloc.copies:
            for o in range(bs): self.kv[dst * bs + o] = self.kv.get(src * bs + o)
        c, pids = seq.num_computed_tokens, prefix_ids(seq)
        for g in range(len(bm.windows)):
            for p, slot in zip(range(c, c + n), bm.slot_mapping(seq, c, c + n, group=g)):
                self.kv[slot] = (pids[p], seq.cache_salt)
        seq.num_computed_tokens += n
        bm.cache_blocks(seq, seq.num_computed_tokens)
        freed = bm.free_skipped(seq)
        if freed: event("a window gave blocks back")
        assert bm.null_block not in freed
        if seq.num_computed_tokens == seq.num_tokens: seq.token_ids.append(data.draw(TOKENS))

    def _earliest_trim(self, seq):
        "The fewest tokens a trim may keep: the next query's window must still be held."
        bs, out = self.bm.block_size, 1
        for t, w in zip(seq.block_tables, self.bm.windows):
            nulls = sum(1 for b in t if b == self.bm.null_block)
            if w is not None: out = max(out, nulls * bs + w - 1)
        return out

    @rule(data=st.data())
    def trim(self, data):
        ids = sorted(i for i, s in self.live.items() if s.num_computed_tokens >= self._earliest_trim(s))
        if not ids: return
        seq = self.live[data.draw(st.sampled_from(ids))]
        k = data.draw(st.integers(self._earliest_trim(seq), seq.num_computed_tokens))
        self.bm.trim(seq, k)
        assert seq.num_computed_tokens == k
        assert all(len(t) == -(-k // self.bm.block_size) for t in seq.block_tables)
        del seq.token_ids[k:]
        seq.token_ids.append(data.draw(TOKENS))

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(TOKENS, max_size=8), salt=st.sampled_from([None, "t"]))
    def lookup(self, prefix, tail, salt):
        seq = Sequence(-1, prefix + tail or [0], cache_salt=salt)
        before = group_state(self.bm)
        hit = self.bm.get_computed_blocks(seq)
        assert group_state(self.bm) == before
        if not self.PREFIX: assert hit == []
        for i, entry in enumerate(hit):
            for g, b in enumerate(entry if isinstance(entry, tuple) else (entry,)):
                if b != self.bm.null_block: assert self.bm.registries[g][seq.block_hashes[i]] == b

    @invariant()
    def consistent(self):
        bm = getattr(self, "bm", None)
        if bm is None: return
        live = list(self.live.values())
        bm.check_invariants(live)
        held = Counter(b for s in live for t in s.block_tables for b in t if b != bm.null_block)
        for b in bm.blocks:
            if b.block_id == bm.null_block: continue
            assert b.ref_count == held[b.block_id]
            assert (bm.block_state(b.block_id) == "used") == (held[b.block_id] > 0)
        bs = bm.block_size
        for s in live:
            pids, n = prefix_ids(s), s.num_computed_tokens
            for g, (t, w) in enumerate(zip(s.block_tables, bm.windows)):
                first = 0 if w is None else max(0, n - w + 1)       # the next query's window reaches back to here
                if w is not None: assert all(b == bm.null_block for b in t[:first // bs]), f"group {g} kept a block its window left"
                for p, slot in zip(range(first, n), bm.slot_mapping(s, first, n, group=g)):
                    assert self.kv.get(slot) == (pids[p], s.cache_salt), f"group {g} position {p} reads foreign K/V"

    def teardown(self):
        bm = getattr(self, "bm", None)
        if bm is None: return
        for s in list(self.live.values()): bm.deallocate(s)
        assert bm.num_used_blocks == 0
        assert all(bm.block_state(i) in ("free", "cached") for i in range(bm.num_blocks) if i != bm.null_block)
        bm.check_invariants([])


class HybridPrefixPoolMachine(HybridPoolMachine):
    PREFIX = True


TestHybridBlockManagerMachine = HybridPoolMachine.TestCase
TestHybridBlockManagerMachine.settings = SETTINGS
TestHybridPrefixCachingBlockManagerMachine = HybridPrefixPoolMachine.TestCase
TestHybridPrefixCachingBlockManagerMachine.settings = SETTINGS


# --- slot mapping ---

@given(table=st.lists(st.integers(0, 99), min_size=1, max_size=8, unique=True), bs=st.sampled_from([1, 2, 4, 16]), data=st.data())
def test_slot_mapping_formula(table, bs, data):
    import numpy as np
    bm = BlockManager(100, block_size=bs)
    s = Sequence(0, range(len(table) * bs)); s.block_table = table
    start = data.draw(st.integers(0, len(table) * bs)); end = data.draw(st.integers(start, len(table) * bs))
    expect = [table[p // bs] * bs + p % bs for p in range(start, end)]
    assert bm.slot_mapping(s, start, end) == expect
    assert compute_slot_mapping(np.array(table), np.arange(start, end), bs).tolist() == expect


# --- bad input ---

def test_more_blocks_than_exist_is_refused_whole():
    bm = BlockManager(8, block_size=4, watermark=0)
    a = Sequence(0, range(10)); bm.allocate(a, 10)
    before = state(bm)
    s = Sequence(1, range(100))
    assert not bm.can_allocate(s, 100)
    with pytest.raises(NoFreeBlocksError, match=r"needs 25 free blocks but only 5 of 8 are free.*only 8 blocks"): bm.allocate(s, 100)
    with pytest.raises(MemoryError): bm.allocate(a, 1000)
    assert state(bm) == before and s.block_table == [] and 1 not in bm.seqs


def test_refusal_includes_copy_on_write_block():
    bm = BlockManager(3, block_size=4, watermark=0)
    a = Sequence(0, range(6)); bm.allocate(a, 6); a.num_computed_tokens = 6
    b = Sequence(1, a.token_ids); bm.fork(a, b)
    assert bm.allocate(b, 1).copies == [(1, 2)]   # the last free block goes to the copy
    before = state(bm)
    with pytest.raises(NoFreeBlocksError): bm.allocate(b, 3)   # needs a new block for position 8
    assert state(bm) == before


def test_free_unknown_or_twice():
    bm = BlockManager(8, block_size=4)
    s = Sequence(0, range(5))
    with pytest.raises(UnknownSequenceError, match="never allocated, or already freed"): bm.deallocate(s)
    bm.allocate(s, 5); bm.deallocate(s)
    with pytest.raises(UnknownSequenceError): bm.deallocate(s)
    with pytest.raises(UnknownSequenceError): bm.trim(s, 1)
    with pytest.raises(UnknownSequenceError): bm.fork(s, Sequence(1, []))
    assert bm.num_free_blocks == 8


@pytest.mark.parametrize("bs", [0, 3, 6, 12, 17, -16, 16.0, "16", True])
def test_block_size_power_of_two(bs):
    with pytest.raises(ValueError, match="power of two"): BlockManager(8, block_size=bs)
    with pytest.raises(ValueError, match="power of two"): check_block_size(bs)


def test_bad_pool_arguments():
    with pytest.raises(ValueError, match="num_blocks"): BlockManager(0)
    with pytest.raises(ValueError, match="num_blocks"): BlockManager(2.5)
    with pytest.raises(ValueError, match="watermark"): BlockManager(8, watermark=1.5)


def test_out_of_range_block_ids():
    bm = BlockManager(8, block_size=4)
    for bad in ([8], [-1], [0, 99], ["1"]):
        with pytest.raises(InvalidBlockError, match=r"0\.\.7"): bm.check_block_table(bad, allow_free=True)
    with pytest.raises(InvalidBlockError, match="free"): bm.check_block_table([0])
    with pytest.raises(InvalidBlockError): bm.block_state(8)
    before = state(bm)
    with pytest.raises(InvalidBlockError, match=r"0\.\.7"): bm.allocate(Sequence(0, range(20)), 4, computed_blocks=[9])
    assert state(bm) == before and 0 not in bm.seqs
    pbm = PrefixCachingBlockManager(8, block_size=4)
    with pytest.raises(InvalidBlockError, match=r"0\.\.7"): pbm.allocate(Sequence(0, range(20)), 4, computed_blocks=[9])


def test_misuse_errors():
    bm = BlockManager(8, block_size=4)
    a = Sequence(0, range(5)); bm.allocate(a, 5)
    with pytest.raises(ValueError, match="no blocks yet"): bm.allocate(a, 1, computed_blocks=[0])
    with pytest.raises(ValueError, match="already live"): bm.fork(a, a)
    with pytest.raises(ValueError, match="another live sequence"): bm.allocate(Sequence(0, range(3)), 3)
    with pytest.raises(ValueError, match=">= 0"): bm.allocate(a, -1)
    with pytest.raises(ValueError, match="outside sequence 0"): bm.slot_mapping(a, 0, 9)
    bm.check_invariants([a])
    with pytest.raises(AssertionError, match="live sequences"): bm.check_invariants([])


def test_watermark_only_binds_admission():
    bm = BlockManager(100, block_size=1, watermark=0.05)
    a = Sequence(0, range(90)); bm.allocate(a, 90); a.num_computed_tokens = 90
    assert not bm.can_allocate(Sequence(1, range(6)), 6)
    assert bm.can_allocate(Sequence(1, range(5)), 5)
    assert bm.can_allocate(a, 10) and not bm.can_allocate(a, 11)
