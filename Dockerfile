# syntax=docker/dockerfile:1.7
# One image for every pdserve component: `pdserve operator`, `pdserve proxy`, `pdserve sim`.
# Stage 1 builds wheels (pdserve and all its dependencies); stage 2 installs them into a clean
# slim image without pip caches, compilers or the source tree.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
# The operator extra (kopf, kubernetes client) and the tracing extra (OpenTelemetry SDK and OTLP
# exporters, loaded only with --otlp-traces-endpoint) are included: one image serves every subcommand.
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[operator,tracing]"

FROM ${PYTHON_IMAGE}
# Must equal the version in pyproject.toml (tests/unit/test_dockerfile.py checks it).
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="Kubernetes-native prefill/decode disaggregated serving for vLLM: operator, router and simulator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/pdserve/pdserve"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# Install from the build stage's wheels through a bind mount, so no wheel file stays in a layer.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels "pdserve[operator,tracing]==${VERSION}" \
    && useradd --system --uid 10001 --gid 0 --no-create-home --shell /usr/sbin/nologin pdserve
USER 10001
WORKDIR /tmp
# Router and simulator default port; the operator's metrics and liveness ports are set by flags.
EXPOSE 8000
ENTRYPOINT ["pdserve"]
CMD ["--help"]
