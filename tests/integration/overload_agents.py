"""An agent on the Anthropic adapter pointed at the test's local stand-in of the API, for the retry-budget tests.

``overloaded``: an :class:`AnthropicModel` allowed two retries per model call, talking to the API the test
process serves on 127.0.0.1 (its URL in ``JUNE_IT_ANTHROPIC_URL``, set in the worker's environment).
"""

from __future__ import annotations

import os

from june_worker import Agent
from june_worker.models.anthropic import AnthropicModel
from tests._anthropic_api import KEY

__all__ = ["ALL"]

ALL = [
    Agent(
        name="overloaded",
        model=AnthropicModel(api_key=KEY, base_url=os.environ["JUNE_IT_ANTHROPIC_URL"], max_retries=2),
    )
]
