# One image for the API, the Celery workers, beat, flower and migrations; the command picks the role.
# vLLM is not in it: the conductor model runs in vLLM's own image (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY conductor ./conductor
RUN pip install ".[otel]" \
    && useradd --create-home --uid 10001 conductor \
    && mkdir -p /data \
    && chown conductor /data

USER conductor
ENV CONDUCTOR_DATA_DIR=/data
EXPOSE 8000 5555
CMD ["conductor", "serve", "--host", "0.0.0.0"]
