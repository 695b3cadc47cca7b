"""`Engine.request_adapters`: the adapters the queued and running requests name (vLLM's
`lora_requests_info` lists), counted per request, read off the step's path."""

from __future__ import annotations

from molora_runtime.routes import LearnedRoute, MixRoute
from tests.molora_runtime.rt_util import request


def test_waiting_then_running_then_idle(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(hot_set={"num_slots": 4})
    reqs = [
        request("a1", [1, 2], "a", 4),
        request("a2", [3, 4], "a", 4),
        request("mix", [5, 6], MixRoute(weights={"a": 0.5, "b": 0.5}), 4),
        request("moe", [7, 8], LearnedRoute(composition="moe"), 4),
        request("base", [9, 10], None, 4),
    ]
    for req in reqs:
        engine.add_request(req)
    queued = engine.request_adapters()
    # a request naming an adapter twice counts once; a learned route names its composition
    assert queued.running == {}
    assert queued.waiting == {"a": 3, "b": 1, "moe": 1}

    engine.step()
    admitted = engine.request_adapters()
    both = {
        name: admitted.running.get(name, 0) + admitted.waiting.get(name, 0)
        for name in {*admitted.running, *admitted.waiting}
    }
    assert both == queued.waiting  # every request is either running or still waiting
    assert admitted.running  # the first step admitted some

    for _ in range(100):
        if not engine.has_work():
            break
        engine.step()
    done = engine.request_adapters()
    assert done.running == {} and done.waiting == {}
