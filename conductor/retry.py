"""The one retry policy for provider calls: exponential backoff with full jitter, honouring Retry-After."""

from __future__ import annotations

import random
from dataclasses import dataclass

from conductor.pool.errors import ProviderError, RateLimited
from conductor.settings import MAX_RETRY_AFTER_S, Settings


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    base_s: float = 1.0
    max_s: float = 60.0

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(settings.step_max_attempts, settings.retry_backoff_base_s, settings.retry_backoff_max_s)

    def should_retry(self, attempt: int, error: ProviderError) -> bool:
        if not error.retryable or attempt >= self.max_attempts:
            return False
        return not (isinstance(error, RateLimited) and (error.retry_after or 0) > MAX_RETRY_AFTER_S)

    def delay(self, attempt: int, error: ProviderError) -> float:
        """Seconds to wait before attempt ``attempt + 1``."""
        if isinstance(error, RateLimited) and error.retry_after is not None:
            return max(0.0, error.retry_after)
        ceiling = min(self.max_s, self.base_s * (2 ** (attempt - 1)))
        return random.uniform(0, ceiling)
