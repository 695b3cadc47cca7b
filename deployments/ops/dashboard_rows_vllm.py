"""Dashboard row for the vLLM-named series: scheduler, caches and latency per replica or LoRA.

Prometheus scrapes Ray's exporter (the PodMonitor), where the series carry Ray's prefix:
`vllm:num_requests_running` on the API port is `ray_vllm_num_requests_running` here.
"""

from __future__ import annotations

from deployments.ops.dashboard_panels import Panel, Row
from deployments.ops.dashboard_promql import Query, grouped, percentiles, rate, sel, split_by
from deployments.telemetry import metric_names as m


def rows() -> list[Row]:
    """The rows of this concern, top to bottom."""
    hits, queries = (f"sum({rate(n)})" for n in (m.VLLM_PREFIX_HITS, m.VLLM_PREFIX_QUERIES))
    accepted, draft_tokens, drafts = (
        f"sum({rate(n)})"
        for n in (m.VLLM_SPEC_ACCEPTED, m.VLLM_SPEC_DRAFT_TOKENS, m.VLLM_SPEC_DRAFTS)
    )
    by_route = "sum by (route_kind, adapter) "
    spec_accepted = rate(m.SPEC_TOKENS, 'kind="accepted"')
    spec_drafted = rate(m.SPEC_TOKENS, 'kind="draft"')
    return [
        (
            "vLLM-named series",
            [
                Panel(
                    "Requests running / waiting",
                    "vllm:num_requests_running and vllm:num_requests_waiting, per replica.",
                    "short",
                    grouped(
                        "replica", {"running": sel(m.VLLM_RUNNING), "waiting": sel(m.VLLM_WAITING)}
                    ),
                ),
                Panel(
                    "KV-cache usage",
                    "vllm:kv_cache_usage_perc: share of KV blocks in use (1 = full), per replica.",
                    "percentunit",
                    split_by("replica", sel(m.VLLM_KV_USAGE), agg="max"),
                ),
                Panel(
                    "Prefix-cache hit rate and preemptions",
                    "Cached prompt tokens over queried ones; preemptions per second.",
                    "short",
                    [
                        Query(f"{hits} / clamp_min({queries}, 1e-9)", "hit rate"),
                        Query(f"sum({rate(m.VLLM_PREEMPTIONS)})", "preemptions/s"),
                    ],
                ),
                Panel(
                    "Queue time",
                    "vllm:request_queue_time_seconds: arrival to first scheduled step.",
                    "s",
                    percentiles(m.VLLM_QUEUE_TIME, ""),
                ),
                Panel(
                    "End-to-end latency by LoRA",
                    "vllm:e2e_request_latency_seconds of finished requests, per LoRA name "
                    "(an adapter, composition or route name, or the route kind).",
                    "s",
                    percentiles(m.VLLM_E2E, "lora_name"),
                ),
                Panel(
                    "Time to first token and inter-token latency",
                    "p90 of vllm:time_to_first_token_seconds and vllm:inter_token_latency_seconds.",
                    "s",
                    [
                        Query(percentiles(m.VLLM_TTFT, "")[1].expr, "p90 time to first token"),
                        Query(percentiles(m.VLLM_ITL, "")[1].expr, "p90 inter-token"),
                    ],
                ),
                Panel(
                    "LoRA requests info (endpoint picker)",
                    "vllm:lora_requests_info per replica: the adapters its running and waiting "
                    "requests asked for, of max_lora slots (legend); the value is the age of the "
                    "newest update, which the Gateway API Inference Extension's picker reads.",
                    "s",
                    [
                        Query(
                            "time() - max by (replica, running_lora_adapters, "
                            f"waiting_lora_adapters, max_lora) ({sel(m.VLLM_LORA_INFO)})",
                            "{{replica}} running [{{running_lora_adapters}}] waiting "
                            "[{{waiting_lora_adapters}}] of {{max_lora}}",
                        )
                    ],
                ),
                Panel(
                    "Speculative decoding acceptance",
                    "Accepted over drafted tokens (vllm:spec_decode_*), in all, per draft position "
                    "and per route kind or adapter; mean accepted length = 1 + accepted / drafts.",
                    "short",
                    [
                        Query(f"{accepted} / clamp_min({draft_tokens}, 1e-9)", "acceptance"),
                        Query(f"1 + {accepted} / clamp_min({drafts}, 1e-9)", "mean length"),
                        Query(
                            f"sum by (position) ({rate(m.VLLM_SPEC_ACCEPTED_PER_POS)})"
                            f" / ignoring(position) group_left clamp_min({drafts}, 1e-9)",
                            "accepted at position {{position}}",
                        ),
                        Query(
                            f"{by_route}({spec_accepted}) / clamp_min({by_route}({spec_drafted}), 1e-9)",
                            "{{route_kind}}{{adapter}}",
                        ),
                    ],
                ),
                Panel(
                    "Prompt and generation tokens / s by LoRA",
                    "vllm:prompt_tokens and vllm:generation_tokens rates per LoRA name.",
                    "short",
                    grouped(
                        "lora_name",
                        {
                            "prompt": rate(m.VLLM_PROMPT_TOKENS),
                            "generation": rate(m.VLLM_GENERATION_TOKENS),
                        },
                    ),
                ),
            ],
        )
    ]
