#!/usr/bin/env python3
"""The lessons' questions, as data: opening lines, "predict, then step" questions and questionnaires, and `apply`.

    python3 tools/lesson_questions.py nbs          # write them into the lesson notebooks (idempotent)
    python3 tools/lesson_questions.py nbs --check  # exit 1 if a notebook would change

Each predict question is placed after an existing cell, named by a short unique substring of its source (`after`);
its answer is a collapsed `<details>` block, which renders folded in Jupyter and on the docs site. The questionnaire
closes the lesson; its answers are in `16_puzzle_solutions`. Cells are found again by their ids, so running `apply`
twice changes nothing.
"""
import json, sys
from pathlib import Path

# Measured with `nbdev-test nbs/<lesson>.ipynb`, one notebook at a time, on a 2-core AMD EPYC machine with 24 GiB
# that other jobs shared at the time (so these are upper bounds); peak memory from `/usr/bin/time -v`.
OPENINGS = {
    "00_kv_cache": ("how many bytes one token's K/V costs, why a cache beats recomputing, and how much a contiguous "
                    "per-request reservation wastes", "Python and PyTorch basics; a CPU is enough"),
    "01_model": ("a Llama-family forward pass (SmolLM2, Llama, Mistral, Qwen, Gemma), with per-layer sliding windows, that loads Hugging Face weights and calls a pluggable attention backend",
        "`00_kv_cache`; a CPU is enough"),
    "02_block_manager": ("paged KV memory: blocks, the free queue, block tables, slot mapping, reference counts and "
                         "fork with copy-on-write", "`00_kv_cache`; no model, no GPU"),
    "02a_plots": ("the colours of every view, the memory map of a pool and its block tables, and the memory-waste "
                  "lab's bars", "`02_block_manager`"),
    "03_prefix_cache": ("hash chains over full blocks, the longest cached prefix, LRU eviction and the hit rate",
                        "`02_block_manager`; no model, no GPU"),
    "03a_hybrid_kv": ("sliding-window and local/global layers (Mistral, Gemma 2 and 3): the KV bytes a window saves, "
                      "vLLM's KV-cache groups over one pool, blocks given back as the window passes, and the prefix "
                      "cache's rule for them, on the real engine", "`03_prefix_cache`; a CPU is enough"),
    "04_paged_attention": ("what paged attention computes, a torch reference, then Triton kernels: KV store, decode over pages with an online softmax, split-K; each layer's sliding window and soft cap",
        "`02_block_manager`; a GPU, or Triton's interpreter on a CPU"),
    "04a_cpu_attention": ("the CPU fast path: a C++ paged kernel that reads pages in place, and only the pages inside a sliding window",
        "`04_paged_attention`; a C++ compiler"),
    "04b_cpu_ops": ("fused layer operations and packed weights for the CPU", "`04a_cpu_attention`; a C++ compiler"),
    "05_scheduler": ("continuous batching under a token budget, chunked prefill and preemption by recompute",
                     "`02_block_manager`, `03_prefix_cache`; no model, no GPU"),
    "05a_engine_args": ("vLLM's `EngineArgs`: every knob of the engine in one place, with its default, its check and its "
                        "help, and the flags, configs and simulator knobs made from it", "`05_scheduler`; no model, no GPU"),
    "06_runner": ("how a step plan becomes flat tensors (positions, slot mapping, block tables) and how many KV pages fit",
                  "`04_paged_attention`, `05_scheduler`"),
    "06a_sampling": ("`SamplingParams` and the batched sampler: temperature, top-p, top-k, min-p, seeds",
                     "`01_model`; a CPU is enough"),
    "06b_engine": ("vLLM's `LLM` API over the paged engine, token-identical to Hugging Face `generate`, with prefix "
                   "caching, streaming and preemption on the real model", "`05_scheduler`, `06_runner`, `06a_sampling`"),
    "07_speculative": ("n-gram and draft-model speculation, and why greedy and rejection-sampled verification are exact",
                       "`06b_engine`"),
    "08_trace": ("the recorded trace of every engine step, the data the widgets draw", "`06b_engine`"),
    "08a_widgets": ("stepping through the real engine: the memory map, the batch, the queues, step by step",
                    "`08_trace`; Jupyter or the docs site"),
    "08b_figures": ("a trace's panels as plain data, the figures built from them, and a page that animates a run "
                    "with no kernel", "`08_trace`"),
    "08c_compare_views": ("contiguous reservation against paging step by step, prefix sharing, two runs side by side, "
                          "and one request's logical blocks mapped to physical ones", "`08b_figures`"),
    "08e_live_engine": ("the engine-side half of live mode: a request typed in, steps run, a rebuild with other "
                        "knobs, as functions of an engine and its trace", "`08_trace`"),
    "08d_attention_views": ("which pages one token reads, and how much of its attention lands on each, from the live "
                            "engine's paged cache", "`04_paged_attention`, `08b_figures`"),
    "09_benchmarks": ("throughput, memory and latency beside Hugging Face and vLLM, measured side by side in one process",
                      "`06b_engine`; optional peers in their own environments"),
    "09e_bench_serving": ("serving measured from the client's side: GuideLLM against `pagednb serve` and `vllm serve`, "
                          "TTFT, inter-token latency and tokens a second under a load", "`09_benchmarks`, `10e_serve`"),
    "09f_bench_cli": ("`pagednb bench`: every benchmark by name, one report, and any engine knob passed to every "
                      "pagednb run", "`05a_engine_args`, `09_benchmarks`, `09e_bench_serving`"),
    "09a_capacity": ("what vLLM's knobs do to a workload on a GPU you do not have: the real scheduler and block manager "
                     "stepped with a roofline cost model, calibrated and checked against this CPU",
                     "`05_scheduler`, `06_runner`, `08a_widgets`; a CPU is enough"),
    "09d_sim_views": ("the simulator behind dropdowns: your model, your GPU, your workload", "`09a_capacity`"),
    "09b_reading_vllm": ("reading your own vLLM: its start-up log explained number by number (what "
                         "`gpu_memory_utilization` and `Maximum concurrency` really mean), checked on 23 published logs, "
                         "and its `/metrics` drawn over time", "`00_kv_cache`, `06_runner`; no GPU, no vLLM"),
    "09c_vllm_events": ("vLLM's block hashes computed exactly, its KV-cache events read live or recorded, and a mirror of "
                        "its prefix cache that says which blocks of a prompt it holds", "`03_prefix_cache`, `09b_reading_vllm`"),
    "10_protocol": ("OpenAI's request bodies and error JSON: strictly typed fields, unknown fields a warning",
                    "`06a_sampling`; no model"),
    "10a_metrics": ("vLLM's `vllm:` Prometheus metrics: histograms, the text exposition, a snapshot of the engine",
                    "`06b_engine`; no model"),
    "10b_core": ("the engine core: one loop that owns the engine, in a thread or in a process of its own, and the "
                 "msgspec messages it exchanges over pipes", "`06b_engine`, `10_protocol`, `10a_metrics`"),
    "10c_core_client": ("the API server's client of an engine core in another process: outputs rebuilt from tokens, "
                        "text decoded, stop strings found", "`10b_core`"),
    "10d_serving": ("how an OpenAI request becomes engine requests, and outputs become responses, whole or streamed",
                    "`10_protocol`, `10c_core_client`"),
    "10e_serve": ("an OpenAI-compatible server (`vllm serve`) over the engine: the HTTP app, its guards and routes",
                  "`10d_serving`"),
    "11_cli": ("the command line", "`10e_serve`"),
}
TIMES = {   # `python3 bootstrap.py test`: each lesson under nbdev-test, two at a time, on a 2-core CPU (AMD EPYC)
    '03a_hybrid_kv': 'runs in 112 s (peak 1.5 GiB) on a 2-core CPU',
    '00_kv_cache': 'runs in 35 s (peak 1.4 GiB) on a 2-core CPU',
    '01_model': "runs in 12 s (peak 1.5 GiB) on a 2-core CPU",
    '02_block_manager': 'runs in 9 s (peak 1.5 GiB) on a 2-core CPU',
    '03_prefix_cache': 'runs in 8 s (peak 1.5 GiB) on a 2-core CPU',
    '04_paged_attention': "runs in 5 s (peak 0.6 GiB) on a 2-core CPU",
    '04a_cpu_attention': "runs in 7 s (peak 1.1 GiB) on a 2-core CPU",
    '04b_cpu_ops': 'runs in 4 s (peak 0.7 GiB) on a 2-core CPU',
    '05_scheduler': 'runs in 7 s (peak 1.5 GiB) on a 2-core CPU',
    '06_runner': 'runs in 2 s (peak 0.4 GiB) on a 2-core CPU',
    '06a_sampling': 'runs in 2 s (peak 0.3 GiB) on a 2-core CPU',
    '06b_engine': 'runs in 16 s (peak 1.7 GiB) on a 2-core CPU',
    '07_speculative': 'runs in 13 s (peak 1.9 GiB) on a 2-core CPU',
    '08_trace': 'runs in 13 s (peak 1.5 GiB) on a 2-core CPU',
    '08a_widgets': 'runs in 21 s (peak 1.4 GiB) on a 2-core CPU',
    '09_benchmarks': 'runs in 30 s (peak 1.9 GiB) on a 2-core CPU',
    '09e_bench_serving': 'runs in 7 s (peak 0.3 GiB) on a 2-core CPU',
    '09f_bench_cli': 'runs in 9 s (peak 0.5 GiB) on a 2-core CPU',
    '09a_capacity': 'runs in 76 s (peak 1.9 GiB) on a 2-core CPU',
    '09b_reading_vllm': 'runs in 11 s (peak 0.1 GiB) on a 2-core CPU',
    '09c_vllm_events': 'runs in 2 s (peak 0.1 GiB) on a 2-core CPU',
    '10_protocol': 'runs in 2 s (peak 0.1 GiB) on a 2-core CPU',
    '10a_metrics': 'runs in 1 s (peak 0.1 GiB) on a 2-core CPU',
    '10b_core': 'runs in 28 s (peak 1.5 GiB) on a 2-core CPU',
    '10c_core_client': 'runs in 57 s (peak 1.5 GiB) on a 2-core CPU',
    '10d_serving': 'runs in 12 s (peak 0.5 GiB) on a 2-core CPU',
    '10e_serve': 'runs in 28 s (peak 1.5 GiB) on a 2-core CPU',
    '11_cli': 'runs in 10 s (peak 1.5 GiB) on a 2-core CPU',
}

PREDICT = {
    "00_kv_cache": [
        dict(after="cap = kv_capacity(LLAMA2_13B, 40e9, max_model_len=2048)",
             q="**Predict:** serve the same LLaMA-2-13B on the same 40 GB in 8-bit (`dtype_bytes=1`). About how many "
               "more KV tokens fit: twice as many, or more?",
             a="About 3.9 times as many (65,917 tokens against 17,089). Halving the bytes does two things: the weights "
               "shrink from 26 GB to 13 GB, so the KV budget grows from 14 GB to 27 GB, *and* each token's K/V halves "
               "to 400 KiB. Run `kv_capacity(LLAMA2_13B, 40e9, dtype_bytes=1, max_model_len=2048)` to see it."),
        dict(after="test_close(contiguous_waste([(200, 300)]*10, 2048), 1 - 500/2048)",
             q="**Predict:** the same ten requests of 200 + 300 tokens, but the server raises `max_model_len` to 4096. "
               "What fraction of the reserved slots is wasted now?",
             a="87.8% (`1 - 500/4096`), up from 75.6%. A contiguous reservation wastes more the longer the longest "
               "allowed request, whatever the requests actually use: that is the knob paging removes."),
        dict(after="pos = [len(prompt) + i for i in range(n_new)]",
             q="**Predict** before looking at the plot: without a cache, how does the time for each new token change "
               "as the sequence grows? And with the cache?",
             a="Without a cache every step recomputes the whole sequence, so the time per token grows roughly in "
               "proportion to its length. With the cache a step computes one token and reads the cached K/V: the "
               "time stays nearly flat (it grows only with the attention read, which is small at these lengths)."),
    ],
    "02_block_manager": [
        dict(after="a.num_computed_tokens = 10",
             q="**Predict, then step:** `a` has 10 tokens in blocks of 4, so 3 blocks, the last holding 2. It decodes "
               "three more tokens. At which of the three does it take a new block, and which block?",
             a="At the third (position 12): positions 10 and 11 fill block 2, position 12 is the first of a fourth "
               "block, block 3, the front of the free queue."),
        dict(after="bm.fork(a, c)",
             q="**Predict:** after `fork`, `c` shares all four of `a`'s blocks (each ref count 2). `c` writes one token "
               "at position 13. Which block is copied, and how many blocks does the pool give out?",
             a="Only block 3, the partly filled last block that position 13 falls into: it is copied into a fresh "
               "block 4 (`copies == [(3, 4)]`), one block from the pool. Blocks 0 to 2 stay shared, nobody writes them; "
               "afterwards block 3 belongs to `a` alone, so `a`'s next write copies nothing."),
        dict(after="test_eq(bm.slot_mapping(a, 10, 13), [10, 11, 12])",
             q="**Predict:** a sequence with block table `[5, 1]` and block size 4. What are the slots of its positions "
               "3, 4 and 5?",
             a="`[23, 4, 5]`: position 3 is offset 3 of block 5 (`5*4 + 3`); positions 4 and 5 are offsets 0 and 1 of "
               "block 1. Neighbouring positions need not be neighbouring slots."),
    ],
    "03a_hybrid_kv": [
        dict(after="WINDOWED[\"layer_types\"][:7]",
             q="**Predict** before the next cells run: 320 tokens are generated with every layer keeping every token, "
               "then with 25 of the 30 layers keeping a window of 64. At the end, how much less memory does the "
               "windowed request hold: about 5/6 less, about half, or about a quarter?",
             a="About two thirds less here, not 5/6: the 5 global layers still keep all 320 tokens, and each window "
               "group keeps its 64 tokens plus a prefill's worth and a partly filled block. The longer the sequence, "
               "the closer the saving gets to 5/6."),
        dict(after="def second_question_hits(llm, answer_len=160):",
             q="**Predict:** with a pool of only 90 blocks, the first answer needs blocks after the window has given "
               "back the document's early blocks. Which group's hits will fall, and what will the hybrid hit be?",
             a="The window groups': the blocks they need (the last 63 tokens before the hit point) were freed first and "
               "are evicted first. The full group keeps the whole document, but a hybrid hit is the minimum over the "
               "groups, so it falls to 0."),
    ],
    "03_prefix_cache": [
        dict(after="plot_memory_map(bm, cols=8)",
             q="**Predict:** a third request's prompt is exactly the first 8 tokens of the system prompt: 2 full "
               "blocks, both cached. How many blocks will it get from the cache?",
             a="One. The last prompt token must always be computed to get the logits of the first output token, so "
               "at most `(8 - 1) // 4 = 1` block can be a hit; the second block is computed again."),
        dict(after="bm.deallocate(b)",
             q="**Predict:** both requests are done, all their blocks are cached-free. A new request needs one block "
               "and no plain free block is left. Which block is evicted, and why that one?",
             a="Block 2, the first in `cached_free`: least recently used. `deallocate` frees a sequence's blocks tail "
               "first, so the tails of a hash chain are evicted before its head, and a shared prefix, needed by "
               "every later request, survives longest."),
        dict(after="system = [rng.randrange(1000, 50000) for _ in range(256)]",
             q="**Predict** before running: 200 requests share a 256-token system prompt and add 20 to 200 tokens of "
               "their own. What hit rate do you expect? And with `block_size=64` instead of 16?",
             a="About 68%: every request after the first finds the 256 shared tokens, which are about two thirds of "
               "its prompt (256 of 256 + 110 on average). With block size 64 the hit rate is the same, because 256 is "
               "a multiple of 64; a prefix of 250 tokens would lose the partial block at either size."),
    ],
    "05_scheduler": [
        dict(after="def seqs_of(lens, start=0):",
             q="**Predict, then step:** three prompts of 50, 10 and 20 tokens, budget 32. What does step 1 run? And "
               "if `max_num_batched_tokens` were 16, how many steps would the whole run take instead of 6?",
             a="Step 1 is `0:p18 1:p10 2:p4`: the rest of prompt 0, all of prompt 1, and a first chunk of 4 tokens "
               "of prompt 2, exactly 32 tokens. With a budget of 16, prompt 0 alone takes 4 steps of prefill and the "
               "run takes 9 steps: a smaller budget means shorter steps (lower latency for decodes) but more of them."),
        dict(after="make_block_manager(16, 4, enable_prefix_caching=False, watermark=0))\nplans = simulate(sched, seqs_of([12]*6)",
             q="**Predict:** six 12-token prompts each grow by 20 tokens in a pool of 16 blocks of 4. Which sequence is "
               "preempted first, and how many blocks come back?",
             a="Sequence 4 at step 1, giving back its 3 blocks (its 12 computed tokens must be computed again later). "
               "The victim is always the newest-arriving running sequence not yet scheduled in this step, so the "
               "oldest requests keep making progress. With 24 blocks there are 3 preemptions instead of 5."),
        dict(after="ready = sched.update(plan)",
             q="**Predict:** in the next step, which runs first: the decode of sequence 0 or the rest of sequence 1's "
               "prompt? Why?",
             a="The decode of sequence 0. Decodes go first: each needs one token of the budget and a user is waiting "
               "for it; prompt chunks take what is left (chunked prefill, as in Sarathi-Serve)."),
    ],
    "06b_engine": [
        dict(after="system = (\"You are a patient teacher",
             q="**Predict:** the first request warms the cache with the system prompt; seven more share it. What will "
               "`num_cached_tokens` be for each of the seven?",
             a="The system prompt's tokens rounded down to whole blocks of 16 (the chat template's shared prefix, in "
               "full blocks): the same number for all seven, each prompt's own question is computed. The hit rate is "
               "below that share because the first request's prompt counts as queried too."),
        dict(after="num_gpu_blocks_override=12, max_model_len=192, enable_prefix_caching=False",
             q="**Predict:** 12 pages of 16 tokens for 6 requests of 40 prompt tokens that each generate 24. Will any be "
               "preempted? Will the output of the preempted ones change?",
             a="Yes: 6 requests of 64 tokens need 4 pages each at the end, 24 pages, twice the pool. The newest running "
               "requests are preempted and recomputed later. Their greedy output does not change: recompute gives the "
               "same K/V, which the test against a request run alone checks."),
    ],
    "07_speculative": [
        dict(after="toks = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]",
             q="**Predict:** what does `ngram_propose(toks + [8], 3)` propose?",
             a="`[9, 1, 2]`: the last 4 tokens `5 6 7 8` (the longest n-gram tried, `prompt_lookup_max=4`) occurred at "
               "the start, followed by `9 1 2`."),
        dict(after="test_eq(greedy_accept([8, 9, 4, 0], [8, 9, 1]), [8, 9, 4])",
             q="**Predict:** `greedy_accept([8, 9, 1, 0], [8, 9, 1])`?",
             a="`[8, 9, 1, 0]`: all three drafts match, and the target's token after the last draft comes free: one "
               "forward, four tokens."),
        dict(after="draft = LLM(parts, **budget",
             q="**Predict:** raise `num_speculative_tokens` from 3 to 8 on this input-grounded request. Does the "
               "acceptance rate go up or down? The tokens per step?",
             a="The acceptance rate (accepted / proposed) goes down: later draft positions are accepted less often, "
               "each needs all before it. Tokens per verify step go up a little, while each step costs more compute; "
               "on a CPU, where a forward over more tokens costs more, the speed-up can shrink."),
    ],
    "08a_widgets": [
        dict(after="knobs = dict(block_size=4, num_gpu_blocks_override=12",
             q="**Predict** before stepping: four prompts in 12 pages of 4 tokens, a budget of 16 tokens a step. What "
               "does step 0 run, and will there be preemptions?",
             a="Step 0 is one 16-token chunk of the first prompt (the budget, chunked prefill). The prompts are longer "
               "than 12 pages can hold all at once, so yes: watch the queues panel for sequences sent back to waiting, "
               "and the map for their pages turning free."),
    ],
    "08c_compare_views": [
        dict(after="cvp = contiguous_vs_paged(tr)",
             q="**Predict:** at the busiest step, how many of the contiguous reservations would fit in this pool?",
             a="Fewer than run in the paged engine: each contiguous reservation is `max_model_len = 48` tokens, 12 "
               "pages, the whole pool, while paged sequences hold only the pages they fill."),
    ],
}

QUESTIONNAIRES = {
    "00_kv_cache": [
        ("Write the formula for the bytes of K/V one token takes, and say what grouped-query attention changes in it.",
         "`2 * num_layers * num_kv_heads * head_dim * dtype_bytes`. Grouped-query attention shares each KV head among "
         "several query heads, so `num_kv_heads` (3 for SmolLM2, 8 for Llama-3-8B) is smaller than the query heads."),
        ("Why does a decode step with a KV cache cost about the same at token 50 as at token 500, when recomputing does not?",
         "With the cache a step computes one token's projections and MLP, and only reads the cached K/V; recomputing "
         "redoes every earlier token's forward too, so its cost grows with the length."),
        ("What are the three losses of a contiguous per-request reservation?",
         "Internal fragmentation (slots reserved to `max_model_len` that the request never fills), reservation (slots "
         "held now for tokens generated later), and external fragmentation (free gaps between slabs too small for a new request)."),
        ("If a workload's requests use on average a quarter of `max_model_len`, what fraction of a contiguous cache is wasted?",
         "About three quarters: waste is `1 - used / (requests * max_model_len)`."),
        ("Why can the KV budget grow faster than 2x when weights go from 16-bit to 8-bit?",
         "The weights shrink too, so more memory is left for the cache, and each token needs half the bytes."),
    ],
    "02_block_manager": [
        ("What is a slot, and how do you get it from a position and a block table?",
         "A slot is one token's place in the flat cache: `block_table[pos // block_size] * block_size + pos % block_size`."),
        ("What does a block's reference count count, and when does a block go back to the free queue?",
         "The number of block tables that hold it; at 0 it is free (at the front of the queue, so it is reused first)."),
        ("After `fork`, which writes need a copy, and which block is copied?",
         "A write into a block whose ref count is above 1: that block is replaced by a fresh one, and copied only if it "
         "already holds computed K/V (usually the partly filled last block). Full blocks nobody writes stay shared."),
        ("Why is `allocate` all or nothing?",
         "So that a failed allocation leaves no half-grown block table: the scheduler can then preempt and retry "
         "without leaking blocks."),
        ("What does paging leave of the three losses of contiguous reservation?",
         "Only internal fragmentation inside each sequence's last block, less than one block per sequence; no "
         "reservation ahead, and no external fragmentation since any free block will do."),
    ],
    "03a_hybrid_kv": [
        ("Why does vLLM put every group's blocks in one pool, and what must be equal for that to work?",
         "So that memory freed by one kind of layer serves any other; a block must be the same size in every group, "
         "so every group holds the same number of layers (padded where the counts differ)."),
        ("Which blocks does a window group give back, and when?",
         "Those whose every position is older than the next query's window (`num_computed - window + 1`), as soon "
         "as the step that passed them is done; the table keeps the null block in their place."),
        ("Why can a hybrid model miss a prefix that its full-attention layers hold?",
         "A hit must be served by every group; a window group needs the blocks just before the hit point, which it "
         "gave back early, so they are the first evicted under pressure."),
        ("What does vLLM's 'maximum concurrency' divide the pool by for a hybrid model?",
         "The blocks one request of max_model_len holds at most: a full group's blocks for every token, a window "
         "group's for its window plus one step's tokens, plus one."),
    ],
    "03_prefix_cache": [
        ("Why does a block's hash include its parent's hash?",
         "So a hash names the whole prefix up to that block, not only its tokens: the same 16 tokens after a different "
         "history have different K/V, and must not be found."),
        ("Why are only full blocks hashed?",
         "A partly filled block still changes as tokens are appended; only a full block's content is final."),
        ("Why can a prompt that is entirely cached still not be served from the cache alone?",
         "The last prompt token must be computed to produce the logits of the first output token, so at most "
         "`(num_tokens - 1) // block_size` blocks are hits."),
        ("Which cached block is evicted first, and why is that a good choice?",
         "The least recently used of the cached blocks nobody holds; since blocks are freed tail first, chain tails go "
         "before the shared heads, which later requests need most."),
        ("What does `cache_salt` protect against?",
         "One tenant learning, through cache hits and their timing, that another tenant sent the same prefix: "
         "different salts give different hash chains."),
    ],
    "05_scheduler": [
        ("What does `max_num_batched_tokens` limit, and what is traded when you lower it?",
         "The tokens one step computes. Lower: shorter steps, so decodes (inter-token latency) wait less behind long "
         "prompts, but prompts take more steps, so time to first token and throughput can suffer."),
        ("Why are decodes scheduled before prompt chunks?",
         "Each decode is one token for a user already waiting; putting them first keeps inter-token latency steady "
         "while prompts fill the rest of the budget (chunked prefill, Sarathi-Serve)."),
        ("Which sequence is preempted when pages run out, and what happens to it?",
         "The newest-arriving running sequence not yet scheduled this step: all its pages are freed and it goes to "
         "the front of the waiting queue, to be recomputed from its tokens."),
        ("What does preemption by recompute cost, and when does prefix caching reduce it?",
         "The preempted sequence's computed tokens are computed again; with prefix caching its full blocks may still be "
         "cached when it returns, so they are hits, not recomputed."),
        ("Why does the scheduler admit no new sequence in a step that preempted one?",
         "Memory is short: admitting new work would only cause more preemptions; the preempted sequence is first in line."),
    ],
    "06b_engine": [
        ("Which knobs of vLLM's `LLM` does the engine take, and what do they change?",
         "`block_size`, `gpu_memory_utilization` (or a KV budget in bytes on CPU), `enable_prefix_caching`, "
         "`enable_chunked_prefill`, `max_num_batched_tokens`, `max_num_seqs`, `max_model_len`, `speculative_config`: "
         "page size, pool size, sharing, step size, concurrency, the longest request, speculation."),
        ("How is the engine checked to be correct?",
         "Greedy outputs are token-identical to Hugging Face `generate` on the same weights, with every feature on or off."),
        ("What do `num_cached_tokens` and the prefix-cache hit rate tell you about a workload?",
         "How much of each prompt was served from shared pages instead of computed: high for shared system prompts."),
        ("Why does a seeded request give the same samples whatever else runs in the batch?",
         "Each request samples with its own generator, seeded from its `seed`, so batch composition does not change its draws."),
        ("What does the engine do with a request that fails in a step?",
         "It confines the failure to that request (it finishes with an error) and keeps serving the others."),
    ],
    "07_speculative": [
        ("Why can verifying k draft tokens cost about as much as decoding one?",
         "Decode is bound by reading the weights and the KV cache; scoring k+1 tokens in one forward reads them once."),
        ("Why is greedy verification exact?",
         "It keeps exactly the tokens the target would have chosen greedily: the matching drafts, then the target's own token."),
        ("State the rejection-sampling rule and why it preserves the target distribution.",
         "Accept draft d with probability `min(1, p(d)/q(d))`; on rejection sample from `max(0, p - q)` normalised. The "
         "accepted mass `min(p, q)` plus the residual sum to exactly `p` (Leviathan et al. 2023; Chen et al. 2023)."),
        ("When does n-gram (prompt-lookup) speculation help, and when does it not?",
         "When the output copies the input (rewriting, code edits, extraction); on free-form chat it rarely proposes "
         "and then costs little but gains little."),
        ("How would you test that a sampler keeps the target distribution?",
         "Draw many first tokens at a fixed seed and compare the histogram with the target probabilities by a "
         "chi-square test, which a wrong sampler fails."),
    ],
    "08a_widgets": [
        ("What does each panel of the stepper show?",
         "The memory map (every page: owner, shared, free, cached), the batch (tokens per sequence in the step against "
         "the budget) and the queues (running, waiting, preempted)."),
        ("Where does the stepper get its data, and why does it match the engine?",
         "From a trace recorded from the real engine at every step; a test compares each panel with the engine's own "
         "state at that step."),
        ("Which knob would you turn live to show preemption, and what would you expect to see?",
         "Lower the number of pages (`num_gpu_blocks_override`): sequences are sent back to waiting and their pages turn free."),
        ("How does the contiguous-versus-paged view make the waste of reservation visible?",
         "It draws, at each step, what contiguous slabs of `max_model_len` would reserve beside the pages actually used."),
        ("What does prefix sharing look like on the memory map?",
         "Several block tables point at the same pages, drawn as shared, with ref counts above 1."),
    ],
}

SOLUTION_NOTES = {}   # puzzle name -> a short note shown above its solution in 16_puzzle_solutions

def _src(cell): return "".join(cell["source"])

def _md(cid, text):
    return dict(cell_type="markdown", id=cid, metadata={}, source=text.strip("\n").splitlines(True))

def predict_text(q):
    "A predict question's markdown: the question, then its answer folded."
    return f"{q['q']}\n\n<details><summary>Answer</summary>\n\n{q['a']}\n\n</details>"

def opening_text(lesson):
    "The three opening lines of a lesson."
    learn, needs = OPENINGS[lesson]
    took = TIMES.get(lesson, "not measured yet")
    return (f"**What you will learn:** {learn}.  \n**What it needs:** {needs}.  \n"
            f"**How long it takes:** it {took}; allow 15 to 30 minutes to read it and answer its questions.")

def questionnaire_text(lesson):
    qs = "\n".join(f"{i}. {q}" for i, (q, _) in enumerate(QUESTIONNAIRES[lesson], 1))
    return f"## Questionnaire\n\nAnswer these without looking back; the answers are in `16_puzzle_solutions`.\n\n{qs}"

def _put(cells, cell, at):
    "Replace the cell with `cell`'s id where it is, else insert it at index `at`; True if anything changed."
    old = next((i for i, c in enumerate(cells) if c.get("id") == cell["id"]), None)
    if old is None:
        cells.insert(at, cell)
        return True
    changed = cells[old]["source"] != cell["source"]
    cells[old]["source"] = cell["source"]
    return changed

def _anchor(cells, needle):
    "Index of the one cell whose source contains `needle` (not one of ours), or None."
    hits = [i for i, c in enumerate(cells) if needle in _src(c) and not str(c.get("id", "")).startswith("lq-")]
    return hits[0] if len(hits) == 1 else None

def apply_one(path: Path, lesson: str) -> dict:
    "Write a lesson's opening lines, predict questions and questionnaire into its notebook; what changed and what was missing."
    nb = json.loads(path.read_text())
    cells, changed, missing = nb["cells"], False, []
    setup = next((i for i, c in enumerate(cells) if c.get("id") == "colab-setup"), 0)
    changed |= _put(cells, _md("lq-opening", opening_text(lesson)), setup + 1)
    for k, q in enumerate(PREDICT.get(lesson, [])):
        cid = f"lq-predict-{k}"
        i = _anchor(cells, q["after"])
        if i is None and not any(c.get("id") == cid for c in cells):
            missing.append(q["after"])
            continue
        changed |= _put(cells, _md(cid, predict_text(q)), (i if i is not None else len(cells)) + 1)
    if lesson in QUESTIONNAIRES: changed |= _put(cells, _md("lq-questionnaire", questionnaire_text(lesson)), len(cells))
    if changed: path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return dict(changed=changed, missing_anchors=missing)

def apply(nbs_dir="nbs", lessons=None) -> dict:
    "Apply the questions to every lesson notebook under `nbs_dir`; returns `{lesson: report}`. Running it twice changes nothing."
    out = {}
    for lesson in lessons or OPENINGS:
        p = Path(nbs_dir)/f"{lesson}.ipynb"
        out[lesson] = apply_one(p, lesson) if p.exists() else dict(changed=False, missing_notebook=True)
    return out

if __name__ == "__main__":
    import shutil, tempfile
    nbs = Path(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "nbs")
    if "--check" in sys.argv:
        tmp = Path(tempfile.mkdtemp())
        for p in nbs.glob("*.ipynb"): shutil.copy(p, tmp/p.name)
        rep = apply(tmp)
        print(json.dumps(rep, indent=1))
        sys.exit(1 if any(r.get("changed") for r in rep.values()) else 0)
    print(json.dumps(apply(nbs), indent=1))
