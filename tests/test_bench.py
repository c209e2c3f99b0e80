"Smoke test of `pagednb bench` (`pagednb.bench_cli.main`) on tiny workloads: it runs, its JSON holds what the tables need."
import json, pytest
from unittest import mock
from pagednb.bench import make_workload, find_vllm_python, host_model, VLLM_ENV
from pagednb.bench_cli import main, format_report

TINY = ["--quick", "--json", "--threads", "1", "--no-hf", "--num-requests", "2", "--system-len", "32", "--long-len", "48",
        "--chunk-budget", "16"]

def test_main_quick_json(capsys, monkeypatch):
    monkeypatch.delenv(VLLM_ENV, raising=False)
    report = main(TINY + ["--only", "throughput,prefix,chunked,profile"])
    out = json.loads(capsys.readouterr().out)                      # --json: stdout is exactly the report
    assert out == json.loads(json.dumps(report))
    assert out["machine"]["torch_threads"] == 1
    r = out["results"]
    assert set(r) == {"throughput", "prefix", "chunked", "profile"}
    pg, vllm = r["throughput"]["rows"]
    assert pg["engine"] == "pagednb" and pg["output_tokens"] > 0 and pg["output_tok_s"] > 0
    assert "skipped" in vllm and VLLM_ENV in vllm["skipped"]
    on, off = r["prefix"]["shared"]
    assert off["prompt_tokens_computed"] == off["prompt_tokens"] > on["prompt_tokens_computed"]
    assert on["ttft_one_at_a_time_mean_s"] > 0 and off["hit_rate"] == 0
    assert [c["config"] for c in r["chunked"]["rows"]] == ["chunked", "not chunked"]
    assert all(c["max_gap_s"] > 0 for c in r["chunked"]["rows"])
    stages = r["profile"]["stages"]
    assert abs(sum(s["seconds"] for s in stages) - r["profile"]["total_s"]) < 0.01
    text = format_report(report)
    for words in ("Offline throughput", "Prefix caching", "Chunked prefill", "Where pagednb's time goes", "threads"):
        assert words in text

@pytest.mark.parametrize("argv, words", [(["--only", "nope"], "unknown benchmark"), (["--threads", "0"], "--threads"),
                                         (["--vllm-python", "/nonexistent/python"], "does not exist"),
                                         (["--only", "guidellm", "--guidellm", "/nonexistent/guidellm"], "PAGEDNB_GUIDELLM")])
def test_bad_arguments(argv, words, capsys):
    with pytest.raises(SystemExit): main(argv)
    assert words in capsys.readouterr().err

class _Stop(Exception): "Stops a benchmark at its engine's construction."

def test_engine_flags_reach_the_engine(monkeypatch):
    "`pagednb bench --quick --only throughput --block-size 32`: the engine gets block_size=32 (stand-in model and LLM)."
    monkeypatch.delenv(VLLM_ENV, raising=False)
    with mock.patch("pagednb.bench_cli.load_model", return_value=host_model(2)), mock.patch("pagednb.bench_cli.load_hf"), \
         mock.patch("pagednb.bench.LLM", side_effect=_Stop) as llm:
        with pytest.raises(_Stop): main(["--quick", "--only", "throughput", "--block-size", "32"])
    assert llm.call_args.kwargs["block_size"] == 32 and llm.call_args.kwargs["max_model_len"] == 2048

@pytest.mark.parametrize("argv, words", [(["--block-size", "24"], "block_size must be a power of two"),
                                         (["--block-size", "x"], "--block-size"),
                                         (["--gpu-memory-utilization", "2"], "gpu_memory_utilization=2.0 is invalid"),
                                         (["--tensor-parallel-size", "2"], "tensor_parallel_size=2")])
def test_bad_engine_flags(argv, words, capsys):
    "An invalid engine knob stops `pagednb bench` before any model is loaded, with `EngineArgs`' own error."
    with mock.patch("pagednb.bench_cli.load_model") as load, pytest.raises(SystemExit):
        main(["--quick", "--only", "throughput"] + argv)
    assert words in capsys.readouterr().err and not load.called

def test_workload_and_vllm_lookup(monkeypatch):
    w = make_workload(3, (4, 8), (2, 3), seed=5)
    assert w.prompts == make_workload(3, (4, 8), (2, 3), seed=5).prompts and len(w.output_lens) == 3
    with pytest.raises(ValueError, match="prompt_len"): make_workload(3, (8, 4))
    monkeypatch.delenv(VLLM_ENV, raising=False)
    assert find_vllm_python() is None

# ---- the GuideLLM serving benchmark: its plumbing, with a stand-in for guidellm (CI has no GuideLLM install) ----------
import os, stat, sys
from pagednb.bench_serving import (GUIDELLM_ENV, find_guidellm, guidellm_command, parse_guidellm, bench_guidellm,
                                   format_guidellm, server_command)
from pagednb.cli import make_parser as cli_parser

def _dist(mean, p50, p95): return dict(successful=dict(mean=mean, median=p50, percentiles=dict(p50=p50, p95=p95)))

REPORT = dict(metadata=dict(guidellm_version="0.8.1"), benchmarks=[dict(duration=3.0, requests=dict(errored=[]), metrics=dict(
    output_tokens_per_second=_dist(50.0, 49.0, 60.0), time_to_first_token_ms=_dist(200.0, 180.0, 400.0),
    inter_token_latency_ms=_dist(40.0, 38.0, 70.0), request_latency=_dist(1.5, 1.4, 2.0),
    request_totals=dict(successful=4, errored=0, incomplete=0, total=4)))])

# A stand-in `guidellm run`: checks the server it is pointed at answers /health and /v1/models, then writes REPORT.
FAKE_GUIDELLM = f'''#!{sys.executable}
import json, os, sys, urllib.request
args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
opts = lambda flag: dict(kv.split("=", 1) for kv in args[flag].split(","))
target = opts("--backend")["target"]
assert urllib.request.urlopen(target + "/health").status == 200
assert json.load(urllib.request.urlopen(target + "/v1/models"))["data"]
json.dump({json.dumps(REPORT)}, open(opts("--output")["path"], "w"))
if "FAKE_GUIDELLM_SEEDS" in os.environ:                          # where the whole-loop test reads the seeds back
    open(os.environ["FAKE_GUIDELLM_SEEDS"], "a").write(opts("--seed")["value"] + "\\n")
'''

def test_guidellm_pieces(tmp_path, monkeypatch):
    cmd = guidellm_command("guidellm", "http://127.0.0.1:8000", "text", "MODEL", "r.json", streams=8, max_requests=16)
    assert cmd[:2] == ["guidellm", "run"] and "kind=concurrent,streams=8" in cmd and "kind=max_requests,count=16" in cmd
    assert any("request_format=/v1/completions" in c for c in cmd)
    r = parse_guidellm(REPORT)
    assert (r["output_tok_s"], r["ttft_p50_ms"], r["itl_p95_ms"], r["errored"], r["first_error"]) == (50.0, 180.0, 70.0, 0, None)
    cmd, env = server_command("vllm", "MODEL", 8001, threads=2, kv_gib=1, python="py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"] and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    cmd, _ = server_command("pagednb", "MODEL", 8001, knobs=dict(block_size=32, enable_prefix_caching=False))
    served = cli_parser().parse_args(cmd[3:])                       # `pagednb serve` reads bench's engine knobs back
    assert (served.block_size, served.enable_prefix_caching, served.max_model_len) == (32, False, 2048)
    monkeypatch.delenv(GUIDELLM_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_guidellm() is None
    with pytest.raises(FileNotFoundError, match=GUIDELLM_ENV): find_guidellm(str(tmp_path / "nope"))

def test_only_guidellm_without_guidellm(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(GUIDELLM_ENV, raising=False)
    monkeypatch.delenv(VLLM_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    out = main(["--only", "guidellm", "--quick", "--json"])
    rows = out["results"]["guidellm"]["rows"]
    assert len(rows) == 1 and GUIDELLM_ENV in rows[0]["skipped"]
    assert "skipped" in format_guidellm(out["results"]["guidellm"])

def test_guidellm_against_pagednb_serve(tmp_path, monkeypatch):
    "The whole loop with the stand-in: `pagednb serve` starts, is probed, stops; the report is parsed into the table."
    fake = tmp_path / "guidellm"
    fake.write_text(FAKE_GUIDELLM)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(GUIDELLM_ENV, str(fake))
    monkeypatch.setenv("FAKE_GUIDELLM_SEEDS", str(tmp_path / "seeds"))
    g = bench_guidellm(find_guidellm(), None, threads=1, quick=True, apis=("text",), loads=[dict(streams=1), dict(rate=2.0)])
    pg, pg2, vllm = g["rows"]
    assert pg["engine"] == "pagednb" and pg["api"] == "text" and pg["output_tok_s"] == 50.0 and pg["errored"] == 0, pg
    assert (pg["load"], pg2["load"]) == ("c1", "p2.0")
    assert (tmp_path / "seeds").read_text().split() == ["42", "43"]          # each load its own prompts
    assert "skipped" in vllm and VLLM_ENV in vllm["skipped"]
    assert "pagednb serve" in format_guidellm(g)

def test_kv_dtype_quick(capsys):
    "`pagednb bench --quick --only kv-dtype`: the drift rows against auto and the decode-attention speed per dtype."
    report = main(["--quick", "--json", "--threads", "1", "--only", "kv-dtype"])
    r = json.loads(capsys.readouterr().out)["results"]["kv-dtype"]
    rows = r["drift"]["rows"]
    want = [("auto", "1.0"), ("fp8_e4m3", "1.0"), ("fp8_e4m3", "measured")]          # quick: e4m3 with and without scales
    assert [(x["kv_cache_dtype"], x["scales"]) for x in rows] == want
    assert rows[0]["top1_short"] == rows[0]["top1_long"] == 1.0 and rows[0]["ppl_change_long_pct"] == 0
    assert rows[1]["bytes_per_token"] * 4 == rows[0]["bytes_per_token"] and 0.5 < rows[1]["top1_long"] <= 1
    assert all(x["ppl_long"] > 1 for x in rows) and rows[2]["mean_k_scale"] != 1.0
    assert {s["kv_cache_dtype"] for s in r["speed"]} >= {"auto", "fp8_e5m2"} and all(s["us"] > 0 for s in r["speed"])
    text = format_report(report)
    assert "KV cache dtype drift" in text and "Decode attention per KV cache dtype" in text
