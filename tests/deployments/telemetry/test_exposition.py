"""`exposition.merge`: Ray exporter texts -> the API port's /metrics text."""

from __future__ import annotations

from deployments.telemetry.exposition import merge

NODE_A = """# HELP ray_molora_requests_total requests
# TYPE ray_molora_requests_total counter
ray_molora_requests_total{Component="core_worker",WorkerId="w1",adapter="acme-secret",route_kind="single",status="ok"} 3.0
ray_molora_requests_total{Component="core_worker",WorkerId="w1",adapter="evil-secret",route_kind="single",status="ok"} 2.0
ray_molora_requests_total{Component="core_worker",WorkerId="w1",adapter="math",route_kind="single",status="ok"} 1.0
# HELP ray_vllm_e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE ray_vllm_e2e_request_latency_seconds histogram
ray_vllm_e2e_request_latency_seconds_bucket{NodeAddress="10.0.0.1",le="1.0",lora_name="math",model_name="base"} 4.0
ray_vllm_e2e_request_latency_seconds_bucket{NodeAddress="10.0.0.1",le="+Inf",lora_name="math",model_name="base"} 5.0
ray_vllm_e2e_request_latency_seconds_sum{NodeAddress="10.0.0.1",lora_name="math",model_name="base"} 2.5
ray_vllm_e2e_request_latency_seconds_count{NodeAddress="10.0.0.1",lora_name="math",model_name="base"} 5.0
# HELP ray_node_cpu_utilization Ray's own
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{NodeAddress="10.0.0.1"} 37.0
"""
NODE_B = """# HELP ray_vllm_e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE ray_vllm_e2e_request_latency_seconds histogram
ray_vllm_e2e_request_latency_seconds_bucket{NodeAddress="10.0.0.2",le="1.0",lora_name="math",model_name="base"} 1.0
ray_vllm_e2e_request_latency_seconds_count{NodeAddress="10.0.0.2",lora_name="math",model_name="base"} 1.0
# HELP ray_vllm_kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE ray_vllm_kv_cache_usage_perc gauge
ray_vllm_kv_cache_usage_perc{NodeAddress="10.0.0.2",model_name="base"} NaN
"""


def test_merge_renames_filters_and_hides_private_names() -> None:
    text = merge([NODE_A, NODE_B, ""], frozenset({"acme-secret", "evil-secret"}))
    lines = text.splitlines()
    assert "acme-secret" not in text and "evil-secret" not in text
    # the two private series coincide once relabelled: summed into one
    assert 'molora_requests_total{adapter="private",route_kind="single",status="ok"} 5.0' in lines
    assert 'molora_requests_total{adapter="math",route_kind="single",status="ok"} 1.0' in lines
    assert "ray_" not in text and "cpu_utilization" not in text  # Ray's own families stay out
    assert "WorkerId" not in text and "Component" not in text
    assert lines.count("# TYPE vllm:e2e_request_latency_seconds histogram") == 1
    assert (
        'vllm:e2e_request_latency_seconds_bucket{NodeAddress="10.0.0.2",le="1.0",'
        'lora_name="math",model_name="base"} 1.0' in lines
    )
    assert (
        'vllm:e2e_request_latency_seconds_bucket{NodeAddress="10.0.0.1",le="+Inf",'
        'lora_name="math",model_name="base"} 5.0' in lines
    )
    assert 'vllm:kv_cache_usage_perc{NodeAddress="10.0.0.2",model_name="base"} NaN' in lines


def test_merge_of_nothing_is_empty_and_garbage_is_skipped() -> None:
    assert merge([]) == ""
    junk = '# TYPE ray_molora_x counter\nray_molora_x{a="1"} notanumber\nnot a line at all\n'
    assert merge([junk]) == ""


# Two exporters: replica r1's node still holds its previous label set (Ray keeps a label set
# for a while after the replica moved on), and r2 on another node.
LORA_A = """# HELP ray_vllm_lora_requests_info Running stats on lora requests.
# TYPE ray_vllm_lora_requests_info gauge
ray_vllm_lora_requests_info{WorkerId="w1",deployment="ModelReplica",max_lora="4",replica="r1",running_lora_adapters="math,old-secret",waiting_lora_adapters=""} 1700000000.0
ray_vllm_lora_requests_info{WorkerId="w1",deployment="ModelReplica",max_lora="4",replica="r1",running_lora_adapters="math,code,+2",waiting_lora_adapters="old-secret,private"} 1700000005.0
"""
LORA_B = """# HELP ray_vllm_lora_requests_info Running stats on lora requests.
# TYPE ray_vllm_lora_requests_info gauge
ray_vllm_lora_requests_info{WorkerId="w2",deployment="ModelReplica",max_lora="8",replica="r2",running_lora_adapters="",waiting_lora_adapters=""} 1700000003.0
ray_vllm_lora_requests_info{WorkerId="w9",deployment="ModelReplica",max_lora="8",replica="r2",running_lora_adapters="",waiting_lora_adapters=""} 1700000004.0
"""


def test_lora_info_keeps_each_replicas_newest_series_and_hides_private_names() -> None:
    text = merge([LORA_A, LORA_B], frozenset({"old-secret"}))
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert "# TYPE vllm:lora_requests_info gauge" in text
    assert "old-secret" not in text
    assert lines == [
        'vllm:lora_requests_info{deployment="ModelReplica",max_lora="4",replica="r1",'
        'running_lora_adapters="math,code,+2",waiting_lora_adapters="private"} 1700000005.0',
        # two workers' series coincide once WorkerId is dropped: the newest time, not a sum
        'vllm:lora_requests_info{deployment="ModelReplica",max_lora="8",replica="r2",'
        'running_lora_adapters="",waiting_lora_adapters=""} 1700000004.0',
    ]
