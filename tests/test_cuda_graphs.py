"Decode graphs without a GPU: the knob's checks, the sizes a faked GPU would capture, and padded replays."
import pytest, torch
from pagednb import runner as R
from pagednb.engine import LLM
from pagednb.sampling import SamplingParams
from pagednb.model import load_model
from helpers import tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", path, num_hidden_layers=3, head_dim=16)
    return load_model(path, dtype="float32", device="cpu")

def tiny_llm(parts, **kw):
    return LLM(parts, log=False, max_model_len=128, num_gpu_blocks_override=64, **kw)

@pytest.mark.parametrize("bad", [[0], [1, -4], "8", [2.0], [True]])
def test_bad_sizes_name_the_knob(parts, bad):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        tiny_llm(parts, cudagraph_capture_sizes=bad)

def test_off_by_default_and_on_a_cpu(parts):
    assert tiny_llm(parts).engine.runner.graphs is None
    assert tiny_llm(parts, cudagraph_capture_sizes=[1, 2, 4]).engine.runner.graphs is None   # a CPU: eager

def test_a_faked_gpu_captures_the_sizes_that_fit(parts, monkeypatch):
    llm = tiny_llm(parts, max_num_seqs=8)
    calls = []
    monkeypatch.setattr(R.ModelRunner, "enable_graphs", lambda self, sizes, n: calls.append((sizes, n)))
    llm.engine.runner.device = torch.device("cuda")
    llm.engine._capture_graphs([1, 4, 8, 16])
    assert calls == [([1, 4, 8], 128)]                             # none larger than max_num_seqs
    llm.engine.enforce_eager = True
    llm.engine._capture_graphs([1, 4])
    assert len(calls) == 1                                         # enforce_eager: none

class Rerun:
    "A CPU stand-in for a CUDA graph: replay runs the recorded function again into its output."
    def __init__(self, fn): self.fn, self.out, self.replays = fn, fn(), 0
    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())

def record(fn, pool=None):
    g = Rerun(fn)
    return g, g.out

def test_replayed_decodes_give_the_eager_tokens(parts):
    prompts = [[5, 6, 7], list(range(20, 45)), [9] * 11]             # 3 decodes: padded to the graph of 4
    want = [o.outputs[0].token_ids for o in tiny_llm(parts).generate(prompts, GREEDY, use_tqdm=False)]
    llm = tiny_llm(parts)
    runner = llm.engine.runner
    runner.graphs = R.DecodeGraphs(runner.model, runner.attn, [1, 2, 4], 8, 128, "cpu")
    runner.graphs.capture(record=record)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    assert runner.graphs.graphs[4].replays >= GREEDY.max_tokens - 2  # the decode steps replayed
    assert runner.graphs.graphs[1].replays == 0
