"""Names of every metric the project exports (shared by the exporters and the dashboard).

Ray prefixes application metrics with `ray_` when it exposes them to Prometheus, so a metric
defined here as `molora_requests_total` is scraped as `ray_molora_requests_total`.
"""

from __future__ import annotations

PROMETHEUS_PREFIX = "ray_"

REQUESTS = "molora_requests_total"  # counter {route_kind, adapter, status}
TOKENS = "molora_tokens_total"  # counter {route_kind, adapter, kind=prompt|completion}
TTFT = "molora_ttft_seconds"  # histogram {route_kind}
INTER_TOKEN = "molora_inter_token_latency_seconds"  # histogram {route_kind}
QUEUE_LENGTH = "molora_queue_length"  # gauge (waiting requests of a replica)
RUNNING = "molora_running_requests"  # gauge
HOTSET_HITS = "molora_hotset_hits_total"  # counter
HOTSET_MISSES = "molora_hotset_misses_total"  # counter
HOTSET_EVICTIONS = "molora_hotset_evictions_total"  # counter
HOTSET_LOADS = "molora_hotset_loads_total"  # counter
HOTSET_LOAD_LATENCY = "molora_hotset_load_latency_seconds"  # histogram
HOTSET_SLOTS_USED = "molora_hotset_slots_used"  # gauge
GATE_TOKENS = "molora_router_gate_tokens_total"  # counter {composition, layer, adapter}
# gate telemetry as cumulative `le` buckets (histogram_quantile reads them; le="+Inf" = tokens)
GATE_ENTROPY_BUCKETS = "molora_router_gate_entropy_bucket_total"  # counter {composition, layer, le}
GATE_ENTROPY_SUM = "molora_router_gate_entropy_sum_total"  # counter {composition, layer}
GATE_TOP1_WEIGHT_BUCKETS = "molora_router_gate_top1_weight_bucket_total"  # {composition, layer, le}
GATE_TOP1_WEIGHT_SUM = "molora_router_gate_top1_weight_sum_total"  # counter {composition, layer}
GATE_TOP1_TOKENS = "molora_router_gate_top1_tokens_total"  # counter {composition, layer, adapter}
# adapter tiers (slot, host, disk): labels are tiers, states and stages only, never adapters
TIER_HITS = "molora_tier_hits_total"  # counter {tier=slot|host|disk}
TIER_MISSES = "molora_tier_misses_total"  # counter {tier}
TIER_LOADS = "molora_tier_loads_total"  # counter {tier}
TIER_EVICTIONS = "molora_tier_evictions_total"  # counter {tier}
TIER_BYTES = "molora_tier_bytes"  # gauge {tier}
TIER_ADAPTERS = "molora_tier_adapters"  # gauge {state=slot|host|loading|disk}
# adapters in a slot or parsed in host memory, by (public) name: bounded by slots + a host cap
# (deployments/replica/lora_info.py); value = how many adapters the row stands for
ADAPTER_RESIDENCY = "molora_adapter_residency"  # gauge {adapter, tier=slot|host, rank, pinned}
LOAD_STAGE_LATENCY = "molora_adapter_load_stage_seconds"  # histogram {stage=fetch|parse|copy}
PLACEMENTS = "molora_placement_total"  # counter {outcome=affinity|host|spill|new|base}
# speculative decoding's drafted and accepted tokens by route kind and adapter/composition
# (public names; a tenant's read `private`; at most MAX_SPEC_NAMES names, then `other`)
SPEC_TOKENS = (
    "molora_spec_decode_tokens_total"  # counter {route_kind, adapter, kind=draft|accepted}
)
# garbage-collector pauses of the router and model replicas (deployments/replica/heap.py)
GC_PAUSE = "molora_gc_pause_seconds"  # histogram {generation=0|1|2}

# vLLM's series (vllm/v1/metrics/loggers.py), same meaning and type. Ray refuses ':' in a name, so
# they are defined as `vllm_*` and served as `vllm:*` on the API port's /metrics (`api_name`).
# Router series carry {model_name, lora_name}; replica series {model_name}.
VLLM_RUNNING = "vllm_num_requests_running"  # gauge
VLLM_WAITING = "vllm_num_requests_waiting"  # gauge
VLLM_KV_USAGE = "vllm_kv_cache_usage_perc"  # gauge, 1 = full
VLLM_PREFIX_QUERIES = "vllm_prefix_cache_queries_total"  # counter (tokens)
VLLM_PREFIX_HITS = "vllm_prefix_cache_hits_total"  # counter (tokens)
VLLM_PREEMPTIONS = "vllm_num_preemptions_total"  # counter
VLLM_QUEUE_TIME = "vllm_request_queue_time_seconds"  # histogram
VLLM_SPEC_DRAFTS = "vllm_spec_decode_num_drafts_total"  # counter
VLLM_SPEC_DRAFT_TOKENS = "vllm_spec_decode_num_draft_tokens_total"  # counter
VLLM_SPEC_ACCEPTED = "vllm_spec_decode_num_accepted_tokens_total"  # counter
VLLM_SPEC_ACCEPTED_PER_POS = "vllm_spec_decode_num_accepted_tokens_per_pos_total"  # {position}
VLLM_E2E = "vllm_e2e_request_latency_seconds"  # histogram
VLLM_TTFT = "vllm_time_to_first_token_seconds"  # histogram
VLLM_ITL = "vllm_inter_token_latency_seconds"  # histogram
VLLM_PROMPT_TOKENS = "vllm_prompt_tokens_total"  # counter
VLLM_GENERATION_TOKENS = "vllm_generation_tokens_total"  # counter
# what the Gateway API Inference Extension's endpoint picker reads for LoRA affinity; value = the
# Unix time of the update (the picker takes the newest series), one current series per replica
VLLM_LORA_INFO = "vllm_lora_requests_info"  # gauge {max_lora, running_lora_adapters, waiting_...}


def _defined(prefix: str) -> tuple[str, ...]:
    """Every name defined above whose value starts with `prefix`, in the order defined."""
    return tuple(
        value
        for key, value in globals().items()
        if key.isupper() and isinstance(value, str) and value.startswith(prefix)
    )


ALL = _defined("molora_")  # our own series
VLLM = _defined("vllm_")  # vLLM's series


def scraped(name: str) -> str:
    """The name under which Prometheus sees `name` (Ray's prefix added)."""
    return PROMETHEUS_PREFIX + name


def api_name(name: str) -> str:
    """The name `name` (as defined here) has on the API port's /metrics: vLLM's `vllm:` form
    for the vLLM series, unchanged for ours."""
    if name.startswith("vllm_"):
        return "vllm:" + name.removeprefix("vllm_")
    return name
