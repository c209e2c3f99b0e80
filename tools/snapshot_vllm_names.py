"""Write the public names of an installed vLLM to a JSON snapshot (run with the Python of a venv that has vLLM).

    /path/to/vllm-venv/bin/python tools/snapshot_vllm_names.py > tests/vllm_names.json

The names come from introspection, not from a list typed by hand: `EngineArgs`' dataclass fields and `LLM.__init__`'s
parameters (the keywords of `LLM(...)`), `SamplingParams`' struct fields, the `--flags` of `vllm serve`'s argument
parser, and the fields of the OpenAI request models (pydantic `model_fields`). `--check FILE` compares the live names
with a snapshot instead and exits 1 on a difference."""
import argparse, dataclasses, inspect, json, sys

def engine_args():
    "The fields of `EngineArgs`, the keywords `LLM(...)` hands to the engine."
    from vllm.engine.arg_utils import EngineArgs
    return sorted(f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_"))

def llm_params():
    "The named parameters of `vllm.LLM.__init__` (the rest go to `EngineArgs` through `**kwargs`)."
    from vllm import LLM
    ps = inspect.signature(LLM.__init__).parameters.values()
    return sorted(p.name for p in ps if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))

def sampling_params():
    "The fields of `vllm.SamplingParams` (a msgspec struct), without private ones."
    from vllm import SamplingParams
    return sorted(f for f in SamplingParams.__struct_fields__ if not f.startswith("_"))

def serve_flags():
    "Every `--flag` of `vllm serve` (the OpenAI server's parser), and its positional arguments by dest."
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    p = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    flags = {s for a in p._actions for s in a.option_strings if s.startswith("--")}
    return sorted(flags - {"--help"}), sorted(a.dest for a in p._actions if not a.option_strings)

def request_fields():
    "The fields of the OpenAI request models of `/v1/chat/completions` and `/v1/completions`, and of `stream_options`."
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    so = ChatCompletionRequest.model_fields["stream_options"].annotation
    so = next((t for t in getattr(so, "__args__", (so,)) if hasattr(t, "model_fields")), None)
    return dict(ChatCompletionRequest=sorted(ChatCompletionRequest.model_fields),
                CompletionRequest=sorted(CompletionRequest.model_fields),
                StreamOptions=sorted(so.model_fields) if so else [])

def snapshot():
    "All of the above, with vLLM's version."
    import vllm
    flags, positionals = serve_flags()
    return dict(vllm_version=vllm.__version__, EngineArgs=engine_args(), LLM=llm_params(), SamplingParams=sampling_params(),
                serve_flags=flags, serve_positionals=positionals, **request_fields())

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", metavar="FILE", help="compare with this snapshot; print the differences, exit 1 if any")
    a = p.parse_args(argv)
    live = snapshot()
    if not a.check:
        print(json.dumps(live, indent=1))
        return 0
    pinned = json.load(open(a.check))
    diff = {k: dict(only_live=sorted(set(live[k]) - set(pinned.get(k, []))), only_snapshot=sorted(set(pinned.get(k, [])) - set(live[k])))
            for k in live if isinstance(live[k], list)}
    diff = {k: v for k, v in diff.items() if v["only_live"] or v["only_snapshot"]}
    if live["vllm_version"] != pinned.get("vllm_version"): diff["vllm_version"] = [pinned.get("vllm_version"), live["vllm_version"]]
    print(json.dumps(diff, indent=1))
    return 1 if diff else 0

if __name__ == "__main__": sys.exit(main())
