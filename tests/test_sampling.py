"SamplingParams' validation and vLLM value rules, the logits processors, the sampler at the extremes, and logprobs."
import math
import pytest, torch
from hypothesis import given, settings, strategies as st, HealthCheck
from pagednb.sampling import (SamplingParams, Logprob, CompletionOutput, RequestOutput, RequestMetrics, probabilities,
                              sample, process_logits, token_logprobs)

INF, NAN = float("inf"), float("nan")

BAD = [  # (field, bad value): the message must name the field
    ("n", True), ("n", 0), ("n", 1.0), ("n", 16385), ("n", "2"), ("n", None),
    ("temperature", True), ("temperature", float("nan")), ("temperature", INF), ("temperature", -0.1),
    ("temperature", 2.5), ("temperature", "1"), ("temperature", None),
    ("top_p", 0), ("top_p", 1.01), ("top_p", float("nan")), ("top_p", True), ("top_p", None),
    ("top_k", True), ("top_k", -2), ("top_k", 1.5), ("top_k", 2**63), ("top_k", None),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("min_p", False),
    ("seed", True), ("seed", 1.5), ("seed", 2**64), ("seed", -2**63 - 1), ("seed", "7"),
    ("max_tokens", True), ("max_tokens", 0), ("max_tokens", 2.0), ("max_tokens", 2**63),
    ("min_tokens", True), ("min_tokens", -1), ("min_tokens", None), ("min_tokens", 17),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", NAN), ("presence_penalty", True),
    ("frequency_penalty", INF), ("frequency_penalty", -3), ("frequency_penalty", None),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", INF), ("repetition_penalty", NAN),
    ("repetition_penalty", False),
    ("logprobs", -2), ("logprobs", False), ("logprobs", 1.0), ("logprobs", 2**63),
    ("prompt_logprobs", -2), ("prompt_logprobs", False), ("prompt_logprobs", "3"),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", True),
    ("ignore_eos", "yes"), ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "false"),
    ("spaces_between_special_tokens", 0),
    ("stop", [""]), ("stop", ""), ("stop", 5), ("stop", ["a", 1]),
    ("stop_token_ids", 5), ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [2**63]),
    ("logit_bias", {1: float("nan")}), ("logit_bias", {1: INF}), ("logit_bias", {"a": 1}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {True: 1.0}), ("logit_bias", {1.5: 1.0}), ("logit_bias", [1, 2]), ("logit_bias", {1: "2"}),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [True]), ("allowed_token_ids", 3),
    ("bad_words", [""]), ("bad_words", ""), ("bad_words", [3]), ("bad_words", 3),
]

@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_value_names_its_field(name, value):
    with pytest.raises(ValueError) as e: SamplingParams(**{name: value})
    assert str(e.value).startswith(f"SamplingParams.{name}=") and " is invalid: " in str(e.value), str(e.value)

def test_cross_field_rules():
    with pytest.raises(ValueError, match=r"^SamplingParams\.min_tokens=5 is invalid: it must be <= max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match=r"^SamplingParams\.n=2 is invalid: greedy"): SamplingParams(n=2, temperature=0)
    with pytest.raises(ValueError, match=r"^SamplingParams\.n=2 is invalid"): SamplingParams(n=2, temperature=1e-6)
    SamplingParams(n=2, temperature=1e-5, min_tokens=5, max_tokens=None)

def test_valid_edges_accepted():
    for kw in [dict(seed=-2**63), dict(seed=2**64 - 1), dict(seed=0), dict(temperature=2), dict(temperature=0),
               dict(top_p=1e-30), dict(min_p=1), dict(top_k=-1), dict(presence_penalty=-2), dict(frequency_penalty=2),
               dict(repetition_penalty=1e-3), dict(logprobs=-1), dict(prompt_logprobs=0), dict(truncate_prompt_tokens=-1),
               dict(max_tokens=None), dict(stop=("a", "b")), dict(allowed_token_ids=(3,)), dict(logit_bias={})]:
        SamplingParams(**kw)

def test_vllm_value_rules():
    for t in [0, 1e-30, 1e-6, 9.99e-6]:
        p = SamplingParams(temperature=t, top_p=0.3, top_k=7, min_p=0.5)
        assert p.greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    p = SamplingParams(temperature=1e-5, top_k=7)
    assert not p.greedy and p.top_k == 7
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams().stop == [] and SamplingParams().bad_words == []
    assert SamplingParams(stop_token_ids=[3, 3, 1]).stop_token_ids == [3, 1]
    assert SamplingParams(logit_bias={"5": 101, 2: -300.0, 3: 0.5}).logit_bias == {5: 100.0, 2: -100.0, 3: 0.5}
    assert SamplingParams(temperature=1).temperature == 1.0 and type(SamplingParams(temperature=1).temperature) is float
    d = SamplingParams()
    knobs = (d.repetition_penalty, d.presence_penalty, d.frequency_penalty, d.logit_bias, d.allowed_token_ids)
    assert knobs == (1.0, 0.0, 0.0, None, None)
    assert (d.include_stop_str_in_output, d.prompt_logprobs, d.spaces_between_special_tokens, d.truncate_prompt_tokens,
            d.skip_special_tokens) == (False, None, True, None, True)

def test_seed_range_is_what_manual_seed_takes():
    for s in [-2**63, 2**64 - 1]: torch.Generator().manual_seed(SamplingParams(seed=s).seed)
    for s in [-2**63 - 1, 2**64]:
        with pytest.raises((RuntimeError, ValueError)): torch.Generator().manual_seed(s)
        with pytest.raises(ValueError, match="SamplingParams.seed="): SamplingParams(seed=s)

def test_verify():
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).verify(50, max_logprobs=-1).prompt_logprobs == 50
    assert SamplingParams(logprobs=20).verify(50).logprobs == 20
    p = SamplingParams(bad_words=["x"])
    p.bad_words_token_ids = [[3, 50]]
    cases = [(SamplingParams(top_k=51), "top_k"), (SamplingParams(stop_token_ids=[50]), "stop_token_ids"),
             (SamplingParams(allowed_token_ids=[0, 50]), "allowed_token_ids"), (SamplingParams(logit_bias={50: 1}), "logit_bias"),
             (SamplingParams(logprobs=21), "logprobs"), (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
             (SamplingParams(logprobs=-1), "logprobs"), (p, "bad_words")]
    for sp, name in cases:
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{name}=.* is invalid: "): sp.verify(50)
    with pytest.raises(ValueError, match=r"^SamplingParams\.logprobs=51 is invalid: it must be <= max_logprobs \(50\)"):
        SamplingParams(logprobs=51).verify(50, max_logprobs=-1)
    SamplingParams(top_k=50, stop_token_ids=[49], allowed_token_ids=[0, 49], logit_bias={49: 1}).verify(50)
    for bad in [dict(vocab_size=0), dict(vocab_size=True), dict(vocab_size=10, max_logprobs=-2)]:
        with pytest.raises(ValueError): SamplingParams().verify(**bad)

class Tok:
    "A word-level toy tokenizer: each piece one id, a leading space part of the piece."
    pieces = ["the", " the", " cat", "cat", " d", "d", "arn", " sat", "ok"]
    def encode(self, text, add_special_tokens=False):
        ids = []
        while text:
            i = max((i for i, p in enumerate(self.pieces) if text.startswith(p)), key=lambda i: len(self.pieces[i]))
            ids.append(i)
            text = text[len(self.pieces[i]):]
        return ids

def test_resolve_bad_words():
    p = SamplingParams(bad_words=["cat", " darn", "cat"])
    assert p.resolve_bad_words(Tok()) == [[3], [2], [5, 6], [4, 6]] == p.bad_words_token_ids
    assert SamplingParams().resolve_bad_words(Tok()) == []
    with pytest.raises(ValueError, match=r"^SamplingParams\.bad_words=.* is invalid: "):
        SamplingParams(bad_words=[" "]).resolve_bad_words(Tok())
    with pytest.raises(ValueError, match="resolve_bad_words"):
        process_logits(torch.zeros(1, 9), [SamplingParams(bad_words=["cat"])], [[0]], [[]])

def test_bad_words_single_and_multi_token():
    p = SamplingParams(bad_words=["cat", "darn"])
    p.resolve_bad_words(Tok())
    lg = torch.zeros(4, 9)
    outs = [[], [5], [0, 4], [5, 0]]               # nothing; ends with "d"; ends with " d"; "d" not at the end
    x = process_logits(lg, [p]*4, [[0]]*4, outs)
    banned = [set(torch.nonzero(torch.isinf(r)).flatten().tolist()) for r in x]
    assert banned == [{2, 3}, {2, 3, 6}, {2, 3, 6}, {2, 3}]

def test_allowed_token_ids_and_logit_bias():
    lg = torch.randn(3, 12)
    ps = [SamplingParams(allowed_token_ids=[4, 7]), SamplingParams(logit_bias={0: -100, 11: 100, 5: 1.5}), SamplingParams()]
    x = process_logits(lg, ps, [[1]]*3, [[2]]*3)
    assert torch.isfinite(x[0]).tolist() == [t in (4, 7) for t in range(12)] and torch.equal(x[0, [4, 7]], lg[0, [4, 7]])
    torch.testing.assert_close(x[1], lg[1] + torch.tensor([-100.0] + [0]*4 + [1.5] + [0]*5 + [100.0]))
    assert torch.equal(x[2], lg[2])
    for _ in range(50): assert int(sample(x[:1], ps[:1])) in (4, 7)
    assert int(sample(x[1:2], [SamplingParams(temperature=0)])) == 11

def test_fast_path_and_no_mutation():
    lg = torch.randn(2, 8, dtype=torch.bfloat16)
    assert process_logits(lg, [SamplingParams()]*2, [[1]]*2, [[1]]*2) is lg
    before = lg.clone()
    x = process_logits(lg, [SamplingParams(repetition_penalty=2.0)]*2, [[1]]*2, [[1]]*2)
    assert torch.equal(lg, before) and x.dtype == torch.float32 and x is not lg

def slow_process(lg, p, prompt, out):
    "One row, the obvious way: a Python loop over the tokens."
    x = lg.clone().float()
    if p.allowed_token_ids: x[[t for t in range(len(x)) if t not in p.allowed_token_ids]] = -INF
    for w in p.bad_words_token_ids or []:
        if len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1]: x[w[-1]] = -INF
    for t, b in (p.logit_bias or {}).items(): x[t] += b
    for t in set(prompt) | set(out): x[t] = x[t]/p.repetition_penalty if x[t] > 0 else x[t]*p.repetition_penalty
    for t in set(out): x[t] -= p.frequency_penalty*out.count(t) + p.presence_penalty
    return x

@pytest.mark.parametrize("seed", range(10))
def test_penalties_match_a_per_row_reference(seed):
    g = torch.Generator().manual_seed(seed)
    S, V = 8, 40
    r = lambda a, b: float(torch.empty(1).uniform_(a, b, generator=g))
    ids = lambda n: torch.randint(0, V, (int(torch.randint(0, n, (1,), generator=g)),), generator=g).tolist()
    ps = []
    for i in range(S):
        kw = dict(repetition_penalty=r(0.3, 3), presence_penalty=r(-2, 2), frequency_penalty=r(-2, 2))
        kw = {k: v for k, v in kw.items() if torch.rand(1, generator=g) < 0.7}
        if i % 3 == 0: kw["logit_bias"] = {t: r(-100, 100) for t in ids(6)} or None
        if i % 4 == 1: kw["allowed_token_ids"] = ids(20) or [0]
        ps.append(SamplingParams(**kw))
        ps[-1].bad_words_token_ids = [ids(4) or [1] for _ in range(3)] if i % 2 else None
    lg = torch.randn(S, V, generator=g)*4
    prompts, outs = [ids(30) for _ in range(S)], [ids(30) for _ in range(S)]
    outs[0] = outs[0] + outs[0][-2:]                                        # some repeats
    got = process_logits(lg, ps, prompts, outs)
    torch.testing.assert_close(got, torch.stack([slow_process(*a) for a in zip(lg, ps, prompts, outs)]))

def test_extreme_repetition_penalty_stays_finite():
    lg = torch.tensor([[0.0, 1.0, -1.0, -INF, 3.0]])
    for rp in [1e-300, 1e300]:
        x = process_logits(lg, [SamplingParams(repetition_penalty=rp)], [[0, 1, 2, 3]], [[]])
        assert not torch.isnan(x).any()
        pr = probabilities(x, [SamplingParams()])
        assert torch.isfinite(pr).all() and abs(float(pr.sum()) - 1) < 1e-5

def test_token_logprobs_ranks_match_argsort():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(6, 50, generator=g).log_softmax(-1)
    order = lp.argsort(-1, descending=True)
    toks = [int(order[i, j]) for i, j in enumerate([0, 3, 49, 10, 1, 0])]
    nums = [5, 0, 3, None, -1, 50]
    res = token_logprobs(lp, toks, nums, decode=lambda t: f"t{t}")
    assert res[3] is None
    for i, k in enumerate(nums):
        if k is None: continue
        d, k = res[i], 50 if k == -1 else k
        rank_of = {int(t): n + 1 for n, t in enumerate(order[i])}
        assert set(d) == {toks[i]} | {int(t) for t in order[i, :k]}
        for t, l in d.items():
            assert isinstance(l, Logprob) and l.rank == rank_of[t] and l.decoded_token == f"t{t}"
            assert math.isclose(l.logprob, float(lp[i, t]), rel_tol=1e-6)
        assert next(iter(d)) == toks[i]                                     # the chosen token first, as vLLM
    assert token_logprobs(lp, toks, [None]*6) == [None]*6
    assert token_logprobs(lp[:1], [0], [2])[0][0].decoded_token is None

def test_output_classes():
    c = CompletionOutput(0, "hi", [1], "stop", [{1: Logprob(-0.5, 1, "hi")}], -0.5, None)
    assert (c.logprobs[0][1].rank, c.cumulative_logprob, c.stop_reason) == (1, -0.5, None)
    o = RequestOutput("a", "p", [1, 2], [c], True, RequestMetrics(0.0))
    assert (o.prompt_logprobs, o.error, o.num_cached_tokens) == (None, None, 0)
    assert RequestOutput("a", "p", [1], [], True, None, [None, {1: Logprob(-1.0)}], "boom").error == "boom"
    assert Logprob(-1.0) == Logprob(logprob=-1.0, rank=None, decoded_token=None)

# ---- the sampler at the extremes
EXTREME_T = [0.0, 1e-30, 1e-6, 1e-5, 1.0001e-5, 1e-3, 0.7, 1.0, 2.0]
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
logit_value = st.one_of(finite32, st.just(-INF), st.sampled_from([0.0, 88.7, -103.0]))

@st.composite
def batch(draw):
    S, V = draw(st.integers(1, 4)), draw(st.integers(1, 24))
    rows = []
    for _ in range(S):
        kind = draw(st.sampled_from(["any", "one finite", "all -inf", "ties"]))
        if kind == "any": rows.append(draw(st.lists(logit_value, min_size=V, max_size=V)))
        elif kind == "ties": rows.append([draw(logit_value)]*V)
        else:
            row = [-INF]*V
            if kind == "one finite": row[draw(st.integers(0, V - 1))] = draw(finite32)
            rows.append(row)
    params = []
    for _ in range(S):
        t = draw(st.one_of(st.sampled_from(EXTREME_T), st.floats(0, 2)))
        top_p = draw(st.one_of(st.sampled_from([1e-30, 1e-6, 0.5, 1.0]), st.floats(0, 1, exclude_min=True)))
        min_p = draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1)))
        p = SamplingParams(temperature=t, top_p=top_p, top_k=draw(st.integers(-1, V + 2)), min_p=min_p)
        if not p.greedy and draw(st.booleans()): p.temperature = draw(st.sampled_from([1e3, 1e6, 1e30]))   # past the API's cap
        params.append(p)
    return torch.tensor(rows, dtype=torch.float32), params

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch(), st.integers(0, 2**32))
def test_probabilities_are_always_a_distribution(b, seed):
    logits, params = b
    pr = probabilities(logits, params)
    assert torch.isfinite(pr).all() and (pr >= 0).all()
    torch.testing.assert_close(pr.sum(-1), torch.ones(len(params)), atol=1e-5, rtol=0)
    has_finite = torch.isfinite(logits).any(-1)
    assert (pr[has_finite[:, None].expand_as(pr) & (logits == -INF)] == 0).all()        # a masked token is never drawn
    toks = sample(logits, params, default_generator=torch.Generator().manual_seed(seed))
    assert (pr[torch.arange(len(params)), toks] > 0).all()
    for i, p in enumerate(params):
        if p.greedy: assert int(toks[i]) == int(logits[i].argmax()) and float(pr[i, toks[i]]) == 1.0

def test_greedy_rows_exact_argmax_in_a_mixed_batch():
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(16, 300, generator=g)*5
    ps = [SamplingParams(temperature=0 if i % 2 else 0.9, top_k=5 if i % 3 else 0) for i in range(16)]
    toks = sample(lg, ps, default_generator=g)
    assert all(int(toks[i]) == int(lg[i].argmax()) for i in range(1, 16, 2))

def test_seeded_rows_ignore_their_batch():
    lg = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=5)
    a = sample(lg, [p]*3, [torch.Generator().manual_seed(5), None, None], torch.Generator().manual_seed(1))
    b = sample(lg[:1], [p], [torch.Generator().manual_seed(5)], torch.Generator().manual_seed(2))
    assert int(a[0]) == int(b[0])
