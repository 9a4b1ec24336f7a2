"""Runs one vLLM engine (CPU build) on token prompts and prints one JSON line with, per prompt,
the greedy tokens, their log-probabilities and num_cached_tokens. A fresh process per engine:
nothing survives in vLLM's own prefix cache between runs."""

import json
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=args["model"], dtype="float32", block_size=32, max_model_len=2048,
              enforce_eager=True, seed=0, prefix_caching_hash_algo="sha256_cbor",
              max_num_batched_tokens=2048,
              distributed_executor_backend=args.get("executor", "uni"))
    if args.get("connector"):
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_connector_extra_config=args["connector"])
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    out = []
    for ids in args["prompts"]:
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        c = r.outputs[0]
        lps = [next(iter(d.values())).logprob if d else None for d in (c.logprobs or [])]
        out.append({"tokens": list(c.token_ids), "logprobs": lps,
                    "num_cached_tokens": r.num_cached_tokens})
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
