# The image every june-worker service runs (worker, beat, flower, gateway); see docker-compose.yml.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md celeryconfig.py ./
COPY june_wire ./june_wire
COPY june_worker ./june_worker
COPY producers ./producers
RUN pip install --no-cache-dir '.[worker,anthropic,flower,gateway]'
USER nobody
CMD ["celery", "-A", "june_worker", "worker", "-l", "INFO"]
