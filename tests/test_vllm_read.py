"""Reading vLLM (`09b_reading_vllm`): every number of 23 start-up logs published in vLLM's issue threads, and the
`/metrics` series recorded from vLLM's CPU build.

Each `tests/fixtures/vllm_logs/NAME.log` is an excerpt of a published log, its text unedited; `NAME.json` names its
source, version, model, GPU and knobs, and under `expected` what the log states, written down by hand from reading it.
The reader must give exactly those numbers, and `None` for every other key of the breakdown: nothing guessed."""
import json, subprocess, sys
from pathlib import Path
import pytest
from pagednb.vllm_read import (KEYS, explain_vllm_log, explain_text, main, memory_segments, metrics_series,
                               parse_prometheus, read_lines, _config)

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT/"tests"/"fixtures"/"vllm_logs"
NAMES = sorted(p.stem for p in LOGS.glob("*.log"))

def _meta(name): return json.loads((LOGS/f"{name}.json").read_text())

def test_enough_fixtures_spanning_versions_sizes_and_kinds():
    metas = [_meta(n) for n in NAMES]
    assert len(metas) >= 10 and all((LOGS/f"{n}.json").exists() for n in NAMES)
    assert {m["engine"] for m in metas} == {"V0", "V1"}
    sizes = {m["knobs"].get("tensor_parallel_size", 1) * m["knobs"].get("data_parallel_size", 1) for m in metas}
    assert {1, 2, 4, 8} <= sizes
    assert any(m.get("moe") for m in metas) and any(m.get("moe") is False for m in metas)
    assert any(m["knobs"].get("kv_cache_dtype") == "fp8" for m in metas) and any(m.get("sliding_window") for m in metas)
    assert sum(not m.get("recorded") for m in metas) >= 10
    for m in metas:
        assert m.get("recorded") or m["source"].startswith("https://github.com/vllm-project/"), m["source"]
        assert {"vllm_version", "model", "gpu", "knobs", "expected"} <= set(m)

@pytest.mark.parametrize("name", NAMES)
def test_reader_reproduces_every_number_the_log_states(name):
    expected, text = dict(_meta(name)["expected"]), (LOGS/f"{name}.log").read_text()
    if expected.pop("no_sizing", False):
        with pytest.raises(ValueError, match="Available KV cache memory"): explain_vllm_log(text)
        config = {}
        for _, line in read_lines(text): _config(line, config)
        assert {k: config.get(k) for k in expected} == expected
        return
    got = explain_vllm_log(text)
    assert {k: got[k] for k in KEYS} == {k: expected.get(k) for k in KEYS}
    assert {k: got.get(k) for k in expected if k not in KEYS} == {k: v for k, v in expected.items() if k not in KEYS}
    assert explain_text(got)                                           # every log has something to explain

@pytest.mark.parametrize("name", NAMES)
def test_breakdown_parts_fit_in_the_gpu(name):
    try: info = explain_vllm_log((LOGS/f"{name}.log").read_text())
    except ValueError: return
    parts = memory_segments(info)
    if info["total_gpu_memory_gib"] and info["gpu_memory_utilization"]:
        assert abs(sum(v for _, v in parts) - info["total_gpu_memory_gib"]) < 0.05, parts

def test_the_reader_imports_no_engine_and_no_torch():
    code = ("import sys, pagednb.vllm_read; bad = {'torch', 'pagednb.engine', 'pagednb.model', 'pagednb.runner', "
            "'pagednb.sim', 'pagednb.widgets', 'pagednb.serve'} & set(sys.modules); print(sorted(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

def test_command_line(tmp_path, capsys):
    log = tmp_path/"vllm.log"
    log.write_text((LOGS/"v1_qwen3-0.6b_a100_flashinfer_bf16.log").read_text())
    assert main([str(log), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu_kv_cache_tokens"] == 652144
    assert main([str(LOGS/"v1_deepseek-v4-flash_8xb200_dp8_no_sizing.log")]) == 2
    assert "no sizing lines" in capsys.readouterr().err

def test_recorded_metrics_series():
    rec = json.loads((ROOT/"tests"/"fixtures"/"vllm_metrics.json").read_text())
    assert rec["command"] and len(rec["scrapes"]) >= 5
    s = metrics_series(rec["scrapes"])
    assert len(s["t"]) == len(rec["scrapes"]) and all(0 <= u <= 1 for u in s["kv_usage"])
    last = parse_prometheus(rec["scrapes"][-1]["text"])
    assert sum(last["vllm:prefix_cache_hits_total"].values()) > 0       # the shared system prompt hit
    assert max(h for h in s["hit_rate"] if h is not None) > 0.5 and sum(s["generation_tps"]) > 0
