import sys
"The CPU attention kernel against the spec: shapes, threads, partial writes, bad input, and the fallback when it cannot be built."
import ctypes, random, warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest, torch
import pagednb.cpu_attention as C
from pagednb.attention import make_paged_problem, paged_attention_spec, paged_attention_torch, store_kv

pytestmark = pytest.mark.skipif(C.cpu_kernel() is None, reason="no C++ compiler: the kernel is unavailable here")

SHAPES = [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 32, 8), (14, 2, 64, 32), (8, 1, 16, 16), (16, 2, 64, 16), (6, 2, 128, 64)]

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(3))
def test_matches_spec(shape, seed):
    H, kvh, D, bs = shape
    rng = random.Random(seed)
    lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 9))]
    qlens = [min(L, rng.choice([1, 1, 2, 5, 16, 40])) for L in lens]     # decode, verify-sized and prefill queries
    p = make_paged_problem(lens, qlens, num_heads=H, num_kv_heads=kvh, head_dim=D, block_size=bs, seed=seed).fill()
    torch.testing.assert_close(C.paged_attention_cpu(*p.args), paged_attention_spec(*p.args), atol=2e-5, rtol=2e-5)

@pytest.mark.parametrize("D", [16, 32, 64, 128])
@pytest.mark.parametrize("G", range(1, 9))
def test_decodes_both_kernels_match_spec(G, D):
    "Decodes on the 16-lane kernel (where compiled) and on the 8-lane one: every head grouping, ragged lengths."
    kvh, bs = 1 + G % 3, (8, 16, 32)[G % 3]
    lens = [1, 7, 16, 17, 40, 129][: 3 + G % 4]
    p = make_paged_problem(lens, num_heads=G * kvh, num_kv_heads=kvh, head_dim=D, block_size=bs, seed=G).fill()
    want = paged_attention_spec(*p.args)
    # the cache holds NaN in every slot no sequence owns: a kernel that read one would not be close
    torch.testing.assert_close(C.paged_attention_cpu(*p.args), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(C.paged_attention_cpu(*p.args, wide=False), want, atol=2e-5, rtol=2e-5)

def test_shared_prefix_and_no_nan():
    p = make_paged_problem([64, 80, 100], [1, 3, 16], num_heads=9, num_kv_heads=3, shared_prefix=48, seed=4).fill()
    out = C.paged_attention_cpu(*p.args)      # the cache holds NaN in every slot no sequence owns
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_spec(*p.args), atol=2e-5, rtol=2e-5)

def test_threads_agree_and_only_given_rows_are_written():
    p = make_paged_problem([5, 200, 33, 120, 17, 64, 300, 1], num_heads=9, num_kv_heads=3, seed=2).fill()
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1); one = C.paged_attention_cpu(*p.args)
        torch.set_num_threads(2); two = C.paged_attention_cpu(*p.args)
    finally: torch.set_num_threads(n)
    torch.testing.assert_close(one, two, atol=0, rtol=0)              # each sequence is summed by one thread, in one order
    out = torch.full_like(p.query, 3.0)
    C.paged_attention_cpu(*p.args, seqs=torch.tensor([1, 6]), out=out)
    assert (out[[0, 2, 3, 4, 5, 7]] == 3.0).all()
    torch.testing.assert_close(out[[1, 6]], one[[1, 6]])

def test_prefill_tiles():
    "Prefills run in tiles of 16 query tokens: fresh prompts, prompts after a cached prefix, tiles cut mid-page, 1 and 2 threads."
    p = make_paged_problem([100, 37, 75, 16, 17], [100, 37, 33, 16, 1], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=5).fill()
    ref, n = paged_attention_spec(*p.args), torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt); torch.testing.assert_close(C.paged_attention_cpu(*p.args), ref, atol=2e-5, rtol=2e-5)
    finally: torch.set_num_threads(n)

def test_kernel_and_torch_backend_agree():
    "A mixed step in any sequence order (the runner gives them costliest first) against the torch backend."
    p = make_paged_problem([13, 30, 40, 45, 9, 120], [1, 4, 40, 20, 1, 1], num_heads=6, num_kv_heads=2, head_dim=64,
                           block_size=8, seed=3).fill()
    ref = paged_attention_torch(*p.args)
    for order in ([2, 3, 1, 5, 0, 4], [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]):
        out = C.paged_attention_cpu(*p.args, seqs=torch.tensor(order, dtype=torch.int32))
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    half = make_paged_problem([13, 30], num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.bfloat16).fill()
    assert not C.cpu_kernel_supports(half.query, half.k_cache)                          # bf16: the torch backend's
    torch.testing.assert_close(paged_attention_torch(*half.args), paged_attention_spec(*half.args), atol=2e-2, rtol=2e-2)

def test_bad_input():
    p = make_paged_problem([20, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8).fill()
    bad = p.block_tables.clone(); bad[0, 1] = 10_000
    with pytest.raises(IndexError, match="out of range"): C.paged_attention_cpu(p.query, p.k_cache, p.v_cache, bad, *p.args[4:])
    with pytest.raises(ValueError, match="float32"): C.paged_attention_cpu(p.query.bfloat16(), p.k_cache.bfloat16(), p.v_cache.bfloat16(), *p.args[3:])
    q = make_paged_problem([20, 9], num_heads=4, num_kv_heads=2, head_dim=48, block_size=8).fill()
    with pytest.raises(ValueError, match="head_dim in"): C.paged_attention_cpu(*q.args)
    with pytest.raises(ValueError, match="out must be"): C.paged_attention_cpu(*p.args, out=torch.empty(3, 4, 32))

def test_build_failure_falls_back(tmp_path, monkeypatch):
    "A compiler that fails: a clear error from the build, one warning, and the torch backend still right."
    with pytest.raises(RuntimeError, match="could not compile"): C.build_cpu_kernel(cache=tmp_path, cxx="/bin/false")
    monkeypatch.setattr(C.cpu_kernel, "_state", {})
    monkeypatch.setenv("PAGEDNB_CACHE", str(tmp_path)); monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setattr(C, "find_cxx", lambda: "/bin/false")
    with pytest.warns(UserWarning, match="unavailable"): assert C.cpu_kernel() is None
    p = make_paged_problem([20, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8).fill()
    torch.testing.assert_close(paged_attention_torch(*p.args), paged_attention_spec(*p.args), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="unavailable"): C.paged_attention_cpu(*p.args)

def test_switched_off(monkeypatch):
    monkeypatch.setenv("PAGEDNB_CPU_KERNEL", "0")
    assert C.cpu_kernel() is None
    p = make_paged_problem([20, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8).fill()
    assert not C.cpu_kernel_supports(p.query, p.k_cache)
    with pytest.raises(RuntimeError, match="PAGEDNB_CPU_KERNEL=0"): C.paged_attention_cpu(*p.args)

def _thp_mode(name):
    p = Path(f"/sys/kernel/mm/transparent_hugepage/{name}")
    return p.read_text().split("[")[1].split("]")[0] if p.exists() else None

def _smaps_kib(address, nbytes, field):
    "kB of `field` summed over this process's mappings that overlap `[address, address + nbytes)`; None: none there."
    total, inside, found = 0, False, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-")); inside = lo < address + nbytes and address < hi
            found |= inside
        elif inside and line.startswith(field + ":"): total += int(line.split()[1])
    return total if found else None

def test_zeros_huge_pages():
    t = C.zeros_huge_pages((16, 1 << 20), torch.float32)                  # 64 MiB
    assert t.shape == (16, 1 << 20) and t.dtype == torch.float32
    assert not C.zeros_huge_pages((16, 1 << 20), torch.float32).any()
    t.fill_(1.0)                  # backed as first written (a read first would map the shared zero page instead)
    if _thp_mode("enabled") not in ("always", "madvise") or _thp_mode("defrag") not in ("always", "madvise", "defer+madvise"):
        pytest.skip("this kernel does not give 2 MiB pages on request")
    huge = _smaps_kib(t.data_ptr(), t.numel() * 4, "AnonHugePages") or 0   # madvise splits the mapping: all its parts
    assert huge >= 32 << 10, f"only {huge} kB of the tensor's mapping is on 2 MiB pages"

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_zeros_huge_pages_costs_ram_only_when_written_and_gives_it_back():
    # The pool's own mapping is measured, not the process's RSS: other threads of a test worker may allocate meanwhile.
    t = C.zeros_huge_pages((2, 30, 4000, 16, 3, 64))                     # 2.6 GiB of KV pool
    address, nbytes = t.data_ptr(), t.numel() * t.element_size()
    rss_mib = lambda: (_smaps_kib(address, nbytes, "Rss") or 0) / 1024
    assert rss_mib() < 64, "allocating must not touch the pool"
    t[:, :, :50] = 1.0
    assert 30 < rss_mib() < 400 and not t[:, :, 50:].any()
    del t
    assert not _smaps_kib(address, nbytes, "Rss"), "the pool's memory must go back when the tensor dies"

def test_store_kv_cpu():
    p = make_paged_problem([20, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8).fill()
    kv, slots = torch.randn(2, 4, 2, 32), torch.tensor([5, -1, 17, 0])
    kc, vc, kt, vt = p.k_cache.clone(), p.v_cache.clone(), p.k_cache.clone(), p.v_cache.clone()
    C.store_kv_cpu(kv[0], kv[1], kc, vc, slots); store_kv(kv[0], kv[1], kt, vt, slots)
    for a, b in ((kc, kt), (vc, vt)): torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(kc.view(-1, 2, 32)[17], kv[0, 2], rtol=0, atol=0)
    with pytest.raises(IndexError, match="out of range"): C.store_kv_cpu(kv[0], kv[1], kc, vc, torch.tensor([5, -1, 17, 10**6]))
    with pytest.raises(ValueError, match="value"): C.store_kv_cpu(kv[0], kv[1, :3], kc, vc, slots)
    with pytest.raises(TypeError, match="dtype"): C.store_kv_cpu(kv[0].double(), kv[1].double(), kc.double(), vc.double(), slots)
    with pytest.raises(ValueError, match="rows of float32, float16, bfloat16"):
        C.store_kv_cpu(kv[0].double(), kv[1].double(), kc, vc, slots, checked=True)
    with pytest.raises(ValueError, match="k_scale"): C.store_kv_cpu(kv[0], kv[1], kc, vc, slots, k_scale=0.0)
    k16, v16 = torch.zeros(kc.shape, dtype=torch.bfloat16), torch.zeros(vc.shape, dtype=torch.bfloat16)
    C.store_kv_cpu(kv[0].half(), kv[1].half(), k16, v16, slots)                    # 16-bit rows, another 16-bit cache
    torch.testing.assert_close(k16.view(-1, 2, 32)[17].float(), kv[0, 2].half().bfloat16().float(), rtol=0, atol=0)


# --- the C++ sources: files shipped in pagednb/csrc, compiled where they lie

def test_sources_are_package_files():
    assert C.CSRC.name == "csrc" and C.CSRC.parent == Path(C.__file__).parent
    assert C.source_files("cpu_attention.cpp") == [C.CSRC/"cpu_attention.cpp", C.CSRC/"cpu_vector.h"]
    assert C.source_files("cpu_ops.cpp") == [C.CSRC/"cpu_ops.cpp", C.CSRC/"cpu_vector.h"]
    assert "pagednb_paged_attention(" in str(C.show_source("cpu_attention.cpp"))
    assert "```cpp" in C.show_source("cpu_vector.h")._repr_markdown_()
    with pytest.raises(FileNotFoundError, match="cpu_attention.cpp"): C.source_path("nope.cpp")
    assert not hasattr(C, "CPU_ATTENTION_SRC")                         # no C++ left in Python strings

def _copy_sources(tmp_path):
    for f in ("cpu_attention.cpp", "cpu_vector.h"): (tmp_path/f).write_text((C.CSRC/f).read_text())
    return tmp_path/"cpu_attention.cpp"

def test_key_hashes_every_included_file(tmp_path):
    cxx = C.find_cxx()
    key = C._build_key(C.source_files("cpu_attention.cpp"), cxx)
    copy = C.source_files(_copy_sources(tmp_path))
    assert copy == [tmp_path/"cpu_attention.cpp", tmp_path/"cpu_vector.h"]       # the copy's own header first
    assert C._build_key(copy, cxx) == key
    (tmp_path/"cpu_vector.h").write_text((tmp_path/"cpu_vector.h").read_text() + "// changed\n")
    assert C._build_key(copy, cxx) != key

def _break(path, old, new):
    "Replace the line whose text is `old` by `new`; return its line number (from 1)."
    lines = path.read_text().splitlines()
    n = next(i for i, l in enumerate(lines) if l.strip() == old)
    lines[n] = lines[n].replace(old, new)
    path.write_text("\n".join(lines) + "\n")
    return n + 1

def test_compile_error_names_file_and_line(tmp_path):
    src = _copy_sources(tmp_path)
    line = _break(src, "*l *= c;", "*l *= not_a_name;")
    with pytest.raises(RuntimeError) as e: C.build_cpu_kernel(src, cache=tmp_path/"cache")
    msg = str(e.value)
    assert f"could not compile the CPU kernel cpu_attention ({src})" in msg
    assert f"{src}:{line}:" in msg and "not_a_name" in msg
    assert msg.count("-O3") == 1                                         # a source error: no other flags tried
    assert [f.name for f in (tmp_path/"cache"/"kernels").iterdir()] == []    # nothing half-built left behind

def test_compile_error_in_header_names_header(tmp_path):
    src = _copy_sources(tmp_path)
    line = _break(tmp_path/"cpu_vector.h", "typedef int32_t i8 __attribute__((vector_size(32)));",
                  "typedef int32_t i8 __attribute__((vector_size(32))) oops;")
    with pytest.raises(RuntimeError, match=f"{tmp_path/'cpu_vector.h'}:{line}:"): C.build_cpu_kernel(src, cache=tmp_path)

def test_copy_without_header_uses_csrc_include_path(tmp_path):
    body = 'extern "C" float pagednb_hsum(const float* p) { return hsum(ld(p)); }'
    (tmp_path/"k.cpp").write_text(f'#include "cpu_vector.h"\n{body}\n')
    assert C.source_files(tmp_path/"k.cpp") == [tmp_path/"k.cpp", C.CSRC/"cpu_vector.h"]
    lib = ctypes.CDLL(str(C.build_cpu_kernel(tmp_path/"k.cpp", cache=tmp_path)))
    lib.pagednb_hsum.argtypes, lib.pagednb_hsum.restype = [ctypes.c_void_p], ctypes.c_float
    assert lib.pagednb_hsum(torch.arange(8.0).data_ptr()) == 28.0

def test_parallel_builds_share_one_file(tmp_path):
    "Two builds of one source into one cache at once: both return the same complete library, and no parts remain."
    build = lambda _: C.build_cpu_kernel("cpu_ops.cpp", cache=tmp_path)
    with ThreadPoolExecutor(2) as ex: libs = list(ex.map(build, range(2)))
    assert libs[0] == libs[1] and libs[0].name.startswith("cpu_ops-")
    assert [f.name for f in libs[0].parent.iterdir()] == [libs[0].name]

# --- sliding windows and soft caps ---------------------------------------------------------------------------
from pagednb.attention import contiguous_attention, TorchAttentionPlan

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(2))
def test_window_and_softcap_match_dense(shape, seed):
    "Windows below, at and above a page; decodes, prefills, chunked prefills; capped and not; both decode kernels."
    H, kvh, D, bs = shape
    rng = random.Random(100 + seed)
    lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 7))]
    qlens = [min(L, rng.choice([1, 1, 3, 16, 40, 300])) for L in lens]
    for W in (1, 5, bs, 2 * bs + 3, 100):
        cap = rng.choice([None, 30.0, 5.0])
        p = make_paged_problem(lens, qlens, num_heads=H, num_kv_heads=kvh, head_dim=D, block_size=bs, seed=seed,
                               sliding_window=W, softcap=cap).fill()
        dense = contiguous_attention(p)           # pages wholly before the window are the NaN null block
        for wide in (True, False):
            out = C.paged_attention_cpu(*p.args, wide=wide, **p.kw)
            said = lambda m: f"W={W} cap={cap} wide={wide}: {m}"
            torch.testing.assert_close(out, dense, atol=2e-5, rtol=2e-5, msg=said)

def test_window_kernel_step_and_torch_backend_agree():
    p = make_paged_problem([13, 300, 40, 45, 9, 120], [1, 4, 40, 20, 1, 1], num_heads=6, num_kv_heads=2, head_dim=64,
                           block_size=16, seed=3, sliding_window=24, softcap=20.0).fill()
    ks = C.KernelStep(p.k_cache, *p.args[3:6], p.slot_mapping, p.scale)
    plan = TorchAttentionPlan(p.block_tables, p.seq_lens, p.query_start_loc, p.k_cache.shape[0], 16, sliding_window=24)
    want = contiguous_attention(p)
    torch.testing.assert_close(ks.attend(p.query, p.k_cache, p.v_cache, **p.kw), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(paged_attention_torch(*p.args, plan=plan, **p.kw), want, atol=2e-5, rtol=2e-5)
    p = make_paged_problem([13, 300, 40], [1, 4, 40], num_heads=6, num_kv_heads=2, head_dim=64, seed=3).fill()
    ks = C.KernelStep(p.k_cache, *p.args[3:6], p.slot_mapping, p.scale)
    assert torch.equal(ks.attend(p.query, p.k_cache, p.v_cache, sliding_window=None, softcap=None),
                       C.paged_attention_cpu(*p.args))                 # None, None: as before

def test_window_block_table_entries_before_the_window_are_never_read(tmp_path):
    "Entries before the window replaced by a block far outside the cache: reading one would crash, so run apart."
    code = """
import torch, pagednb.cpu_attention as C
from pagednb.attention import make_paged_problem, contiguous_attention
p = make_paged_problem([200, 90, 33], [1, 5, 33], num_heads=9, num_kv_heads=3, block_size=16, sliding_window=40,
                       softcap=30.0).fill()
bt = p.block_tables.clone()
bt[bt == 0] = 2**30                                 # the null block's entries: no longer a block at all
for wide in (True, False):
    out = C.paged_attention_cpu(p.query, p.k_cache, p.v_cache, bt, *p.args[4:], checked=True, wide=wide, **p.kw)
    torch.testing.assert_close(out, contiguous_attention(p), atol=2e-5, rtol=2e-5)
print("ok", int((p.block_tables == 0).sum()))
"""
    import subprocess
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "ok" and int(r.stdout.split()[1]) >= 10     # pages 0..9 of sequence 0 nulled

def test_window_decode_time_stops_growing():
    "One long decode: with a window of 256 the kernel reads 17 pages instead of 512, so it must be clearly faster."
    import time
    p = make_paged_problem([8192], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16).fill()
    def best(**kw):
        C.paged_attention_cpu(*p.args, checked=True, **kw)
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            C.paged_attention_cpu(*p.args, checked=True, **kw)
            ts.append(time.perf_counter() - t)
        return min(ts)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)                       # one thread: no waiting on a second one on a busy machine
        assert best(sliding_window=256) * 3 < best()
    finally: torch.set_num_threads(n)

def test_window_bad_args():
    p = make_paged_problem([20, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8).fill()
    with pytest.raises(ValueError, match="sliding_window must be"): C.paged_attention_cpu(*p.args, sliding_window=-1)
    with pytest.raises(ValueError, match="softcap must be"): C.paged_attention_cpu(*p.args, softcap=-2.0)
