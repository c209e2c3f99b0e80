"""The memory map and the pools of `02a_plots` as data: cells per block, the titles and legend names they state."""
import pytest
from pagednb.block_manager import BlockManager, Sequence, memory_snapshot
from pagednb.plots import plot_memory_map, plot_kv_dtype_pools, kv_dtype_note

def _cells(fig, name=None):
    "Cells drawn (closed polygons) by the filled traces of `fig`, or by the one called `name`."
    return sum(list(t.x).count(None) for t in fig.data if t.fill == "toself" and name in (None, t.name))

def test_memory_map_states_the_cache_dtype():
    bm = BlockManager(12, block_size=4, watermark=0)
    bm.allocate(Sequence(0, range(6)), 6)
    plain = plot_memory_map(bm)
    fig = plot_memory_map(bm, kv_cache_dtype="bfloat16", bytes_per_token=96)
    assert plain.layout.title.text == "12 blocks of 4: 2 used, 10 free, 0 cached-free"
    assert fig.layout.title.text == plain.layout.title.text + "<br><sup>" + kv_dtype_note("bfloat16", 96, 4) + "</sup>"
    assert "kv_cache_dtype=bfloat16: 96 B per token, 384 B per block" in fig.layout.title.text
    assert _cells(fig) == _cells(plain) == 12 + 2                        # the pool's blocks and the table's two cells
    snap = dict(memory_snapshot(bm), kv_cache_dtype="fp8", bytes_per_token=48)   # a recorded snapshot may carry it
    assert "kv_cache_dtype=fp8: 48 B per token" in plot_memory_map(snap).layout.title.text
    with pytest.raises(ValueError, match="needs bytes_per_token"): plot_memory_map(bm, kv_cache_dtype="fp8")

@pytest.mark.parametrize("pool", [256 * 1024, 300 * 1024])
def test_pools_hold_more_blocks_in_fewer_bits(pool):
    per_block = dict(float32=16 * 1024, bfloat16=8 * 1024, fp8=4 * 1024)
    fig = plot_kv_dtype_pools(pool, per_block)
    want = {n: pool // b for n, b in per_block.items()}
    assert [t.name for t in fig.data] == [f"{n}: {k} blocks of {per_block[n]:,} B" for n, k in want.items()]
    assert [_cells(fig, t.name) for t in fig.data] == list(want.values())
    widths = [t.x[1] - t.x[0] for t in fig.data]                       # each cell as wide as its block's bytes
    assert widths == pytest.approx([4 - .08, 2 - .08, 1 - .08])
    assert f"{pool:,} B of KV pool" in fig.layout.title.text
