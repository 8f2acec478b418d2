# pagedq gateway image: `pagedq serve` with the producer and the gateway only (no engine).
FROM python:3.11.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md pagedq_cli.py ./
COPY producer producer
COPY gateway gateway
RUN pip install ".[gateway]"

RUN useradd --create-home --uid 10001 pagedq
USER pagedq
EXPOSE 8000
ENTRYPOINT ["pagedq"]
