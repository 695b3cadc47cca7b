"""Gate telemetry as counter increments: bounded labels, cumulative buckets, exact values."""

from __future__ import annotations

import random

from deployments.telemetry import metric_names as m
from deployments.telemetry.gate_metrics import gate_samples
from molora_runtime.engine.route_stats.gate_telemetry import LayerTelemetry
from molora_runtime.model.learned_gate import ENTROPY_BUCKETS, TOP1_BUCKETS

LAYERS = 4
EXPERTS = {"maths": ["arithmetic", "sorting"], "trio": ["a", "b", "c"]}


def random_layer(rng: random.Random, n: int) -> LayerTelemetry:
    entropies = [rng.random() for _ in range(rng.randint(0, 50))]
    weights = [rng.uniform(0.3, 1.0) for _ in entropies]
    firsts = [rng.randrange(n) for _ in entropies]
    return LayerTelemetry(
        tokens=len(entropies),
        entropy_sum=sum(entropies),
        top1_weight_sum=sum(weights),
        entropy_buckets=[sum(e <= b for e in entropies) for b in ENTROPY_BUCKETS],
        top1_weight_buckets=[sum(w <= b for w in weights) for b in TOP1_BUCKETS],
        top1_expert=[firsts.count(k) for k in range(n)],
    )


def test_labels_stay_bounded_over_many_intervals() -> None:
    rng = random.Random(0)
    seen: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for _ in range(200):  # many stats intervals: the label sets must not grow with traffic
        telemetry = {
            c: [random_layer(rng, len(e)) for _ in range(LAYERS)] for c, e in EXPERTS.items()
        }
        for metric, tags, value in gate_samples(telemetry, EXPERTS.__getitem__):
            assert value >= 0
            seen.setdefault(metric, set()).add(tuple(sorted(tags.items())))
    les_e = len(ENTROPY_BUCKETS) + 1
    les_w = len(TOP1_BUCKETS) + 1
    comps, experts = len(EXPERTS), sum(len(e) for e in EXPERTS.values())
    assert len(seen[m.GATE_ENTROPY_BUCKETS]) <= comps * LAYERS * les_e
    assert len(seen[m.GATE_TOP1_WEIGHT_BUCKETS]) <= comps * LAYERS * les_w
    assert len(seen[m.GATE_ENTROPY_SUM]) == comps * LAYERS
    assert len(seen[m.GATE_TOP1_TOKENS]) == experts * LAYERS
    adapters = {dict(t)["adapter"] for t in seen[m.GATE_TOP1_TOKENS]}
    assert adapters == {a for e in EXPERTS.values() for a in e}
    assert {dict(t)["layer"] for t in seen[m.GATE_ENTROPY_SUM]} == {str(i) for i in range(LAYERS)}


def test_values_of_one_layer() -> None:
    layer = LayerTelemetry(
        tokens=10,
        entropy_sum=2.5,
        top1_weight_sum=7.0,
        entropy_buckets=[0, 0, 4, 4, 4, 4, 4, 10, 10, 10, 10],
        top1_weight_buckets=[0, 0, 0, 0, 6, 6, 6, 6, 6, 10],
        top1_expert=[7, 0, 3],
    )
    empty = LayerTelemetry(0, 0.0, 0.0, [0] * 11, [0] * 10, [0, 0, 0])
    samples = gate_samples({"trio": [layer, empty]}, EXPERTS.__getitem__)
    by = {(metric, tuple(sorted(tags.items()))): v for metric, tags, v in samples}
    base = (("composition", "trio"), ("layer", "0"))
    assert by[(m.GATE_ENTROPY_SUM, base)] == 2.5
    assert by[(m.GATE_TOP1_WEIGHT_SUM, base)] == 7.0
    assert by[(m.GATE_ENTROPY_BUCKETS, (*base[:1], ("layer", "0"), ("le", "0.2")))] == 4
    assert by[(m.GATE_ENTROPY_BUCKETS, (*base[:1], ("layer", "0"), ("le", "+Inf")))] == 10
    assert by[(m.GATE_TOP1_WEIGHT_BUCKETS, (*base[:1], ("layer", "0"), ("le", "0.95")))] == 6
    assert by[(m.GATE_TOP1_TOKENS, (("adapter", "a"), *base))] == 7
    assert by[(m.GATE_TOP1_TOKENS, (("adapter", "c"), *base))] == 3
    assert not any(dict(k[1])["layer"] == "1" for k in by)  # no tokens, no increments
    versions = {"trio@v1": [layer], "trio@v2": [layer]}
    experts = {"trio@v1": EXPERTS["trio"], "trio@v2": EXPERTS["trio"]}
    labelled = gate_samples(versions, experts.__getitem__, lambda ref: ref.split("@")[0])
    assert {tags["composition"] for _, tags, _ in labelled} == {"trio"}  # versions add no series
    assert (m.GATE_TOP1_TOKENS, (("adapter", "b"), *base)) not in by  # zero: skipped
