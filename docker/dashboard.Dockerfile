# rq-dashboard for pagedq: pinned versions (RQ as the workers use it), JSON serializer only.
FROM python:3.11.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# rq-dashboard 0.9.0 imports six without declaring it.
RUN pip install "rq-dashboard==0.9.0" "rq==3.0.0" "six==1.17.0"
COPY dashboard.py /app/dashboard.py

RUN useradd --create-home --uid 10001 dashboard
USER dashboard
EXPOSE 9181
ENTRYPOINT ["python", "/app/dashboard.py"]
