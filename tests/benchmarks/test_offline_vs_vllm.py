"""`benchmarks.offline_vs_vllm`'s bookkeeping: the per-side summary (median CPU per token, the
ratio to vLLM's) and the timing of one generation against the process's own counters."""

from __future__ import annotations

from benchmarks.offline_vs_vllm import schedstat, summarize, timed


def _sample(cpu: float, tps: float, waited: float) -> dict[str, float]:
    return {"tokens": 64, "cpu_ms_per_token": cpu, "tok_per_s": tps, "ran_s": 1.0,
            "waited_s": waited}  # fmt: skip


def test_summary_takes_medians_and_the_ratio_to_vllm() -> None:
    runs = {
        "vllm": [_sample(2.0, 100, 1.0), _sample(3.0, 90, 2.0), _sample(2.5, 95, 3.0)],
        "molora:auto": [_sample(2.4, 80, 0.5), _sample(2.6, 85, 0.7), _sample(9.9, 10, 9.0)],
    }
    out = summarize(runs)
    assert out["vllm"]["cpu_ms_per_token"] == 2.5 and out["vllm"]["tok_per_s"] == 100
    assert out["molora:auto"]["cpu_ms_per_token"] == 2.6  # one slow outlier does not move it
    assert out["molora:auto"]["vllm_cpu_per_token_ratio"] == round(2.5 / 2.6, 2)
    assert "vllm_cpu_per_token_ratio" not in out["vllm"]


def test_timed_counts_this_process_cpu_and_tokens() -> None:
    def burn() -> int:
        total = 0
        for i in range(300_000):
            total += i * i
        return 100 if total else 0

    ran0, _ = schedstat()
    row = timed(burn)
    assert row["tokens"] == 100
    assert row["cpu_ms_per_token"] > 0 and row["tok_per_s"] > 0
    assert row["ran_s"] >= 0 and row["waited_s"] >= 0
    assert schedstat()[0] >= ran0
