"""Runs one vLLM engine (CPU build) on token prompts and prints one JSON line with, per prompt,
the greedy tokens, their log-probabilities and num_cached_tokens (or the error the engine
reported). A fresh process per engine: nothing survives in vLLM's own prefix cache between runs.

Arguments (one JSON object): model, prompts, connector (extra config; none = no connector),
executor, policy (kv_load_failure_policy), batch (all prompts in one generate call),
gpu_blocks (num_gpu_blocks_override, to force preemption), abort (prompts submitted, stepped
once, then aborted before the rest run), hints (per prompt: its kv_transfer_params, or null)."""

import json
import sys


def result(r) -> dict:
    c = r.outputs[0]
    if c.finish_reason == "error":
        return {"error": "finish_reason=error", "num_cached_tokens": r.num_cached_tokens}
    lps = [next(iter(d.values())).logprob if d else None for d in (c.logprobs or [])]
    return {"tokens": list(c.token_ids), "logprobs": lps, "num_cached_tokens": r.num_cached_tokens}


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=args["model"], dtype="float32", block_size=32, max_model_len=2048,
              enforce_eager=True, seed=0, prefix_caching_hash_algo="sha256_cbor",
              max_num_batched_tokens=2048, disable_log_stats=False,
              distributed_executor_backend=args.get("executor", "uni"))
    if args.get("gpu_blocks"):
        kw["num_gpu_blocks_override"] = args["gpu_blocks"]
        kw["max_model_len"] = (args["gpu_blocks"] - 1) * 32  # one block is the null block
    if args.get("connector"):
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role=args.get("role", "kv_both"), kv_connector_extra_config=args["connector"],
            kv_load_failure_policy=args.get("policy", "fail"))
    if args.get("kv_events"):
        from vllm.config import KVEventsConfig
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=args["kv_events"], topic="")
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=args.get("max_tokens", 8), logprobs=0)
    aborted = []
    engine = llm.llm_engine
    for i, ids in enumerate(args.get("abort", [])):
        rid = f"abort-{i}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
        engine.step()
        engine.abort_request([rid])
        aborted.append(rid)
    for _ in range(50):  # let the aborted loads finish and their blocks be freed
        if not engine.has_unfinished_requests():
            break
        engine.step()
    phases = args.get("phases")
    if phases:
        # Prompt groups run one after the other; after each, one PHASE line, then the engine
        # waits for a line on stdin (the test changes the world meanwhile, e.g. restarts
        # kvtierd under this running engine).
        for i, group in enumerate(phases):
            outs = [result(llm.generate([TokensPrompt(prompt_token_ids=p)], sp,
                                        use_tqdm=False)[0]) for p in group]
            print("PHASE " + json.dumps({"outputs": outs}), flush=True)
            if i < len(phases) - 1:
                sys.stdin.readline()
        return
    out = []
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in args["prompts"]]
    # Per-prompt kv_transfer_params (None: none), as the OpenAI server passes them.
    hints = args.get("hints") or [None] * len(prompts)
    sps = [sp if h is None else SamplingParams(
        temperature=0.0, max_tokens=args.get("max_tokens", 8), logprobs=0,
        extra_args={"kv_transfer_params": h}) for h in hints]
    try:
        if args.get("batch"):
            out = [result(r) for r in llm.generate(prompts, sps, use_tqdm=False)]
        else:
            for p, s in zip(prompts, sps):
                out.append(result(llm.generate([p], s, use_tqdm=False)[0]))
    except Exception as e:  # noqa: BLE001 - reported to the test, which decides
        out.append({"error": f"{type(e).__name__}: {e}"})
    preemptions = 0
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            preemptions = int(getattr(m, "value", 0))
    sched = llm.llm_engine.vllm_config.scheduler_config
    print("RESULT " + json.dumps({"outputs": out, "aborted": aborted,
                                  "preemptions": preemptions,
                                  "hybrid_allocator": not sched.disable_hybrid_kv_cache_manager}),
          flush=True)


if __name__ == "__main__":
    main()
