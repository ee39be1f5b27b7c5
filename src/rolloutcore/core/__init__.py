"""The pure core (layer 1): the lifecycle state machine and the types it speaks.

Standard library only, no threads, clocks or I/O (``tests/test_layering.py``
checks it): ``lifecycle`` (states, transitions, failure policy),
``versions`` (weight versions and identities), ``evidence`` (what adapters
observe), ``records`` (the journal's record schema), ``invariants`` (checked
from a journal alone), ``tables`` (the state-machine document). Import from
the modules; the common names are also at ``rolloutcore``.
"""

__all__: list[str] = []
