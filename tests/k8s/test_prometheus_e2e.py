"""End to end: the app on a local Ray cluster, a real Prometheus scraping Ray's metrics port, and
every metric the dashboard queries found there with values.

The Serve app runs the tiny random model with three adapters and one learned composition, with
two hot-set slots so that adapter loads and evictions really happen. Prometheus (the Debian
package, installed by scripts/test_services.sh) scrapes 127.0.0.1:<Ray metrics port>; then each
panel expression of the dashboard is evaluated by Prometheus itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from deployments.ops import dashboard, dashboard_promql
from deployments.telemetry import metric_names as m
from tests.k8s.dashboard_queries import RARE, exported_names, metric_names, targets
from tests.start_once import StartOnce
from tests.support.local_ray import ClusterStartError, start_local_cluster, stop_local_cluster
from tests.support.ports import free_port, retry_on_address_in_use

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (run scripts/test_services.sh)"
)

ADAPTERS = ("alpha", "beta", "gamma")
COMPOSITION = "duo"
APP = "molora"


def _start_ray() -> Any:
    import ray

    if ray.is_initialized():
        # An earlier folder's fixture kept its cluster (tests/cluster tears its own down).
        pytest.fail("a Ray cluster is already running in this process", pytrace=False)
    return start_local_cluster(num_cpus=4, system_config={"metrics_report_interval_ms": 1000})


# Started by tests/conftest.py's setup hook for the first test that needs `serving`: a start that
# fails (twice: it is retried on fresh ports) is one error with Ray's log tails.
RAY = StartOnce("serving", _start_ray, stop_local_cluster, errors=(ClusterStartError,))


def _wait(what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached in {timeout}s (last: {last!r})")


def _make_store(root: Path) -> tuple[Path, Path]:
    """Tiny model + store: three PEFT adapters (random weights) and a 2-expert composition."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from adapter_store import open_registry
    from molora_runtime.lora.composition import CompositionConfig, save_composition
    from molora_runtime.model.tiny import make_tiny_model

    model_dir = make_tiny_model(root / "model", with_tokenizer=True)
    registry = open_registry(str(root / "store"), create=True)
    base_model = None
    for seed, name in enumerate(ADAPTERS, start=1):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        lora.init_lora_weights = False
        get_peft_model(base, lora).save_pretrained(root / "work" / name)
        base_model = registry.publish_adapter(root / "work" / name, name, "v1").base_model
    assert base_model is not None
    config = CompositionConfig(
        base_model=base_model, adapters=list(ADAPTERS[:2]), top_k=1, num_layers=2, hidden_size=64
    )
    torch.manual_seed(7)
    folder = save_composition(root / "work" / COMPOSITION, config, torch.randn(2, 2, 64))
    registry.publish_composition(folder, COMPOSITION, "v1")
    return model_dir, root / "store"


@pytest.fixture(scope="module")
def serving(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    from ray import serve

    cluster = RAY.ensure(request.node.nodeid)
    root = tmp_path_factory.mktemp("e2e")
    try:
        model_dir, store = _make_store(root)
        from deployments.app import build
        from deployments.config import ServeConfig

        cfg = ServeConfig.from_args(
            {
                "engine": {
                    "model": str(model_dir),
                    "device": "cpu",
                    "dtype": "float32",
                    "max_num_seqs": 4,
                    "max_model_len": 256,
                    "max_num_batched_tokens": 256,
                    "enable_cuda_graph": False,
                    "hot_set": {"num_slots": 2, "max_rank": 8},
                    "speculative": {"method": "ngram", "prompt_lookup_min": 1},
                },
                "store": {"url": str(store), "cache_dir": str(root / "cache"), "refresh_s": 1},
                "served_model_name": "tiny-base",
            }
        )
        # min == max keeps one replica on two CPUs while Serve's autoscaler still reports.
        scaling = {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 4}
        app = build(cfg, replica_options={"autoscaling_config": scaling})
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        url = cluster.url
        _wait("app healthy", lambda: httpx.get(f"{url}/v1/models", timeout=10).is_success, 240)
        yield {"url": url, "metrics_port": cluster.metrics_port}
    finally:
        RAY.stop()


@pytest.fixture(scope="module")
def prometheus(serving: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("prometheus")
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: ray\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{serving['metrics_port']}']\n"
    )
    assert PROMETHEUS is not None
    log_path = root / "prometheus.log"
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> str:
        port = free_port()
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HOME": str(root)},
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if proc.poll() is not None:  # exited: say why (a lost port is retried)
                raise RuntimeError(f"prometheus exited: {log_path.read_text(errors='replace')}")
            return httpx.get(f"{url}/-/ready", timeout=5).is_success

        _wait("prometheus ready", ready, 60)
        return url

    try:
        yield retry_on_address_in_use(start, cleanup=lambda: _stop(procs[-1]))
    finally:
        for proc in procs:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


def _chat(url: str, model: str, *, stream: bool = False) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 6,
        "temperature": 0.0,
        "stream": stream,
        "ignore_eos": True,  # the random model may stop at once; we need tokens and gaps
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _query(prom: str, expr: str) -> dict[str, Any]:
    answer = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    payload = answer.json()
    assert payload.get("status") == "success", f"{expr}: {payload}"
    return payload["data"]


def _sent_traffic(serving: dict[str, Any]) -> int:
    url = serving["url"]
    sent = 0
    # Base, each adapter twice (2 slots for 3 adapters: loads and LRU evictions), a static mix,
    # the learned composition, streaming (inter-token gaps) and one unknown name (a 4xx status).
    models = ["tiny-base", *ADAPTERS, *ADAPTERS, "alpha:0.5+beta:0.5", COMPOSITION]
    for model in models:
        answer = _chat(url, model)
        assert answer.status_code == 200, (model, answer.text)
        sent += 1
    assert _chat(url, COMPOSITION, stream=True).status_code == 200
    assert _chat(url, "gamma", stream=True).status_code == 200
    assert _chat(url, "no-such-adapter").status_code == 404
    return sent + 2  # answered requests (whether a 404 is counted is the router's business)


@pytest.fixture(scope="module")
def scraped(serving: dict[str, Any], prometheus: str) -> dict[str, Any]:
    requests = _sent_traffic(serving)
    names = sorted(exported_names() - RARE)

    def all_present() -> list[str] | None:
        missing = [n for n in names if not _query(prometheus, n)["result"]]
        return None if missing else names

    try:
        _wait("every dashboard metric in Prometheus", all_present, 120, interval=2)
    except TimeoutError:
        missing = [n for n in names if not _query(prometheus, n)["result"]]
        pytest.fail(f"metrics the dashboard queries never appeared in Prometheus: {missing}")
    return {"prometheus": prometheus, "requests": requests}


def _value(prom: str, expr: str) -> float:
    result = _query(prom, expr)["result"]
    return sum(float(sample["value"][1]) for sample in result)


def test_project_metrics_have_values(scraped: dict[str, Any]) -> None:
    prom = scraped["prometheus"]
    total = f"sum({m.scraped(m.REQUESTS)})"
    try:  # the last requests may still be on their way through Ray's metrics agent
        _wait("all requests counted", lambda: _value(prom, total) >= scraped["requests"], 30)
    except TimeoutError:
        pytest.fail(f"{_value(prom, total)} requests counted, {scraped['requests']} answered")
    adapters = {s["metric"].get("adapter") for s in _query(prom, m.scraped(m.REQUESTS))["result"]}
    assert set(ADAPTERS) <= adapters
    assert _value(prom, f'sum({m.scraped(m.TOKENS)}{{kind="completion"}})') > 0
    assert _value(prom, f"sum({m.scraped(m.TTFT)}_count)") >= scraped["requests"] - 1
    assert _value(prom, f"sum({m.scraped(m.INTER_TOKEN)}_count)") > 0
    assert _value(prom, f"sum({m.scraped(m.HOTSET_EVICTIONS)})") >= 1
    assert _value(prom, f"sum({m.scraped(m.HOTSET_LOADS)})") >= len(ADAPTERS)
    assert _value(prom, f"sum({m.scraped(m.GATE_TOKENS)})") > 0
    assert _value(prom, f"sum({m.scraped(dashboard_promql.SERVE_REPLICAS_HEALTHY)})") >= 2


def test_every_panel_expression_evaluates(scraped: dict[str, Any]) -> None:
    """Prometheus parses every panel query (variables as Grafana would fill them)."""
    prom = scraped["prometheus"]
    board = dashboard.dashboard_json()
    for target in targets(board):
        expr = (
            target["expr"]
            .replace("$__rate_interval", "1m")
            .replace("$application", APP)
            .replace("$adapter", ".*")
        )
        assert metric_names(expr), expr
        _query(prom, expr)
    hit_rate = _value(
        prom,
        dashboard_promql.hit_rate().replace("$__rate_interval", "5m").replace("$application", APP),
    )
    assert 0 <= hit_rate <= 1


def test_gate_telemetry_reaches_prometheus(scraped: dict[str, Any]) -> None:
    """The learned requests' gate folds arrive per layer, as cumulative buckets of the composition."""
    prom = scraped["prometheus"]
    comp = f'composition="{COMPOSITION}"'  # the catalog name: no version in the label
    entropy = m.scraped(m.GATE_ENTROPY_BUCKETS)

    def counts() -> tuple[float, float]:  # the top bound is 1 (entropy is normalized)
        series = _query(prom, f"{entropy}{{{comp}}}")["result"]
        by_le: dict[str, float] = {}
        for sample in series:
            le = sample["metric"]["le"]
            by_le[le] = by_le.get(le, 0.0) + float(sample["value"][1])
        return by_le.get("+Inf", 0.0), by_le.get("1", 0.0)

    try:
        tokens = _wait(
            "gate entropy buckets", lambda: (c := counts())[0] > 0 and c[0] == c[1] and c[0], 30, 1
        )
    except TimeoutError:
        pytest.fail(f"entropy buckets (+Inf, 1): {counts()}; series: {_query(prom, entropy)}")
    assert _value(prom, f'sum({m.scraped(m.GATE_TOP1_WEIGHT_BUCKETS)}{{{comp}, le="1"}})') > 0
    mean = _value(prom, f"sum({m.scraped(m.GATE_ENTROPY_SUM)}{{{comp}}})") / tokens
    assert 0 <= mean <= 1
    layers = {s["metric"]["layer"] for s in _query(prom, m.scraped(m.GATE_TOP1_TOKENS))["result"]}
    assert layers == {"0", "1"}  # the tiny model's two layers, nothing else
