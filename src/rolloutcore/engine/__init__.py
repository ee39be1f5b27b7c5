"""Real vLLM engines that RolloutCore starts and owns (tests, benchmarks, restarts)."""

from .launcher import DEFAULT_ENV, ManagedEngine, free_port, require_vllm, vllm_available

__all__ = ["DEFAULT_ENV", "ManagedEngine", "free_port", "require_vllm", "vllm_available"]
