"""Verifying what the engine holds (layer 2).

``checksums`` (reference checksums of a checkpoint against vLLM's
``/weight_checker``), ``probe`` (a policy probe computed from the tensors
sent). Import from the modules.
"""

__all__: list[str] = []
