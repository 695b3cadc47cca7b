"""The dashboard's vLLM-named panels, as plain specs (PromQL from `metric_names`), so the
dashboard builder turns them into panels and this module needs nothing of it.

Prometheus scrapes Ray's exporter (the PodMonitor), where the series carry Ray's prefix:
`vllm:num_requests_running` on the API port is `ray_vllm_num_requests_running` here.
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.ops import metric_names as m

APP = 'application=~"$application"'
RATE = "[$__rate_interval]"
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: list[tuple[str, str]]  # (PromQL, legend)


def _sel(metric: str, suffix: str = "") -> str:
    return f"{m.scraped(metric)}{suffix}{{{APP}}}"


def _rate(metric: str, suffix: str = "") -> str:
    return f"rate({_sel(metric, suffix)}{RATE})"


def _percentiles(histogram: str, by: str) -> list[tuple[str, str]]:
    labels = f"le, {by}" if by else "le"
    legend = f" {{{{{by}}}}}" if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({labels}) ({_rate(histogram, '_bucket')}))",
            f"p{round(q * 100)}{legend}",
        )
        for q in QUANTILES
    ]


def vllm_rows() -> list[tuple[str, list[PanelSpec]]]:
    """One row: vLLM's scheduler, cache and latency series, per replica or LoRA name."""
    hits, queries = (f"sum({_rate(n)})" for n in (m.VLLM_PREFIX_HITS, m.VLLM_PREFIX_QUERIES))
    return [
        (
            "vLLM-named series",
            [
                PanelSpec(
                    "Requests running / waiting",
                    "vllm:num_requests_running and vllm:num_requests_waiting, per replica.",
                    "short",
                    [
                        (f"sum by (replica) ({_sel(m.VLLM_RUNNING)})", "running {{replica}}"),
                        (f"sum by (replica) ({_sel(m.VLLM_WAITING)})", "waiting {{replica}}"),
                    ],
                ),
                PanelSpec(
                    "KV-cache usage",
                    "vllm:kv_cache_usage_perc: share of KV blocks in use (1 = full), per replica.",
                    "percentunit",
                    [(f"max by (replica) ({_sel(m.VLLM_KV_USAGE)})", "{{replica}}")],
                ),
                PanelSpec(
                    "Prefix-cache hit rate and preemptions",
                    "Cached prompt tokens over queried ones; preemptions per second.",
                    "short",
                    [
                        (f"{hits} / clamp_min({queries}, 1e-9)", "hit rate"),
                        (f"sum({_rate(m.VLLM_PREEMPTIONS)})", "preemptions/s"),
                    ],
                ),
                PanelSpec(
                    "Queue time",
                    "vllm:request_queue_time_seconds: arrival to first scheduled step.",
                    "s",
                    _percentiles(m.VLLM_QUEUE_TIME, ""),
                ),
                PanelSpec(
                    "End-to-end latency by LoRA",
                    "vllm:e2e_request_latency_seconds of finished requests, per LoRA name "
                    "(an adapter, composition or route name, or the route kind).",
                    "s",
                    _percentiles(m.VLLM_E2E, "lora_name"),
                ),
                PanelSpec(
                    "Time to first token and inter-token latency",
                    "vllm:time_to_first_token_seconds and vllm:inter_token_latency_seconds.",
                    "s",
                    _percentiles(m.VLLM_TTFT, "")[1:2] + _percentiles(m.VLLM_ITL, "")[1:2],
                ),
                PanelSpec(
                    "Prompt and generation tokens / s by LoRA",
                    "vllm:prompt_tokens and vllm:generation_tokens rates per LoRA name.",
                    "short",
                    [
                        (
                            f"sum by (lora_name) ({_rate(m.VLLM_PROMPT_TOKENS)})",
                            "prompt {{lora_name}}",
                        ),
                        (
                            f"sum by (lora_name) ({_rate(m.VLLM_GENERATION_TOKENS)})",
                            "generation {{lora_name}}",
                        ),
                    ],
                ),
            ],
        )
    ]
