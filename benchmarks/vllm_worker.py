"""Runs one yardstick workload in vLLM (its own virtualenv) and prints timings as JSON.

Called by `benchmarks/yardsticks.py` as `VLLM_PYTHON benchmarks/vllm_worker.py SPEC.json`; kept
free of project imports because vLLM lives in a separate environment (`make vllm-env`).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=spec["max_model_len"],
        enforce_eager=True,
        enable_lora=True,
        max_loras=len(spec["adapters"]),
        max_lora_rank=spec["rank"],
        max_num_seqs=spec["max_batch"],
        seed=0,
    )
    loras = {
        name: LoRARequest(name, i + 1, path)
        for i, (name, path) in enumerate(spec["adapters"].items())
    }
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True, temperature=0.0)
    results = []
    for case in spec["cases"]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in case["prompts"]]
        lora = [loras[n] if n else None for n in case["adapters"]]
        llm.generate(prompts[:1], params, lora_request=lora[:1], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results.append({"name": case["name"], "seconds": elapsed, "tokens": tokens})
    print("VLLM_RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
