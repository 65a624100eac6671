"""Operating june-worker: Prometheus metrics, OpenTelemetry traces and structured logs (docs/operations.md).

* :mod:`.metrics`: the counters and histograms worker processes record (multiprocess mode);
* :mod:`.state`: gauges read from Postgres and the broker when scraped;
* :mod:`.serve`: the worker main process's ``/metrics`` server;
* :mod:`.turns`: a turn run's span, step spans, metrics and transition logs (the engine's TurnHooks);
* :mod:`.tracing`: trace context in and out of Celery messages;
* :mod:`.logs`: transition log lines and the JSON formatter.

The engine knows none of this: it calls the hooks a host hands it (june_worker/engine/hooks.py).
"""
