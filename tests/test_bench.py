"Smoke test of `pagednb bench` (`pagednb.bench.main`) on tiny workloads: it runs, its JSON holds what the tables need."
import json, pytest
from pagednb.bench import main, format_report, make_workload, find_vllm_python, VLLM_ENV

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
                                         (["--vllm-python", "/nonexistent/python"], "does not exist")])
def test_bad_arguments(argv, words, capsys):
    with pytest.raises(SystemExit): main(argv)
    assert words in capsys.readouterr().err

def test_workload_and_vllm_lookup(monkeypatch):
    w = make_workload(3, (4, 8), (2, 3), seed=5)
    assert w.prompts == make_workload(3, (4, 8), (2, 3), seed=5).prompts and len(w.output_lens) == 3
    with pytest.raises(ValueError, match="prompt_len"): make_workload(3, (8, 4))
    monkeypatch.delenv(VLLM_ENV, raising=False)
    assert find_vllm_python() is None
