"""Where the tests find Postgres and Redis.

Interim version: ``JUNE_DATABASE_URL`` / ``JUNE_REDIS_URL`` or the local defaults. To be
replaced by the full provisioning (throwaway servers from local binaries, one clear
failure line otherwise).
"""

from __future__ import annotations

import os


def postgres_url() -> str:
    return os.environ.get("JUNE_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")


def redis_url() -> str:
    return os.environ.get("JUNE_REDIS_URL", "redis://127.0.0.1:6379/0")
