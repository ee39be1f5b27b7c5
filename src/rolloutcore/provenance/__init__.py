"""Provenance of every sample (layer 4): what produced it, checked after the fact.

``trajectory`` (the record schema), ``recorder`` (crash-safe trajectory
files), ``seeds`` (derived sampling seeds), ``audit`` (version purity and
group diversity), ``replay`` (does an engine at the recorded version
reproduce the record). Import from the modules.
"""

__all__: list[str] = []
