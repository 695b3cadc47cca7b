"""`deployments.ops.kube_plan.plan`: Serve autoscaling and the GPU worker group are sized to agree."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.ops import kube_groups, kube_plan, kube_profile


def _config(**replica: object) -> dict:
    return {
        "http_options": {"host": "127.0.0.1", "port": 9000, "request_timeout_s": 5},
        "applications": [
            {
                "name": "molora",
                "import_path": "deployments.app:build_app",
                "deployments": [
                    {"name": "ModelReplica", "ray_actor_options": {"num_gpus": 1}, **replica},
                    {"name": "Router", "num_replicas": 2},
                ],
            }
        ],
    }


def _replica(plan: kube_plan.Plan) -> dict:
    return plan.serve_config["applications"][0]["deployments"][0]


def test_group_sized_from_serve_autoscaling() -> None:
    scaling = {"min_replicas": 3, "max_replicas": 10, "target_ongoing_requests": 16}
    plan = kube_plan.plan(_config(autoscaling_config=scaling), kube_profile.BASE)
    assert (plan.min_workers, plan.max_workers) == (3, 10)
    assert _replica(plan)["autoscaling_config"] == scaling
    assert plan.serve_config["http_options"] == {
        "host": "0.0.0.0",
        "port": kube_profile.PROXY_PORT_HEAD,
        "request_timeout_s": 5,
    }


def test_fixed_replicas_become_autoscaling() -> None:
    plan = kube_plan.plan(_config(num_replicas=2), kube_profile.BASE)
    replica = _replica(plan)
    assert "num_replicas" not in replica
    assert replica["autoscaling_config"]["min_replicas"] == 2
    assert replica["autoscaling_config"]["target_ongoing_requests"] == 8
    assert plan.serve_config["applications"][0]["deployments"][1]["num_replicas"] == 2


def test_fixed_bounds_clamp_serve() -> None:
    scaling = {"min_replicas": 2, "initial_replicas": 4, "max_replicas": 16}
    plan = kube_plan.plan(_config(autoscaling_config=scaling), kube_profile.DEV)
    assert (plan.min_workers, plan.max_workers) == (0, 1)
    assert _replica(plan)["autoscaling_config"] == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 1,
    }


def test_half_gpu_replicas_share_a_node() -> None:
    config = _config(autoscaling_config={"min_replicas": 2, "max_replicas": 6})
    config["applications"][0]["deployments"][0]["ray_actor_options"]["num_gpus"] = 0.5
    plan = kube_plan.plan(config, kube_profile.BASE)
    assert (plan.min_workers, plan.max_workers) == (1, 3)


def test_profile_rejects_cpu_only_workers() -> None:
    with pytest.raises(ValidationError, match=r"worker\.gpus"):
        kube_profile.ClusterProfile(worker=kube_groups.PodResources(cpu="4", memory="8Gi"))
