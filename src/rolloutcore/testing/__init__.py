"""Test parts that ship with the package (layer 3), for fast tests and the demo.

``fake`` (an in-process simulated engine and its adapter), ``faultproxy``
(fault injection between a client and a real engine), ``models`` (tiny
offline checkpoints vLLM loads). Import from the modules.
"""

__all__: list[str] = []
