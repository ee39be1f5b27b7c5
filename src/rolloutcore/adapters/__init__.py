"""Adapters (layer 3): engine effects behind the port, ``control.port.LifecycleAdapter``.

``vllm`` is the real engine over HTTP (``vllm.process``: the managed server
process; ``vllm.support``: which vLLM is supported). The simulated engine
is ``rolloutcore.testing.fake``.
"""

__all__: list[str] = []
