"""Building Hugging Face models from several threads: one lock for every load.

transformers (5.x) builds and loads a model inside context managers that patch
process-wide attributes and put back what they saw on entry
(``initialization.no_tie_weights`` replaces ``PreTrainedModel.tie_weights``,
``no_init_weights`` the ``torch.nn.init`` functions). Two loads that overlap in
threads put back each other's patch: from then on every model the process
builds is left untied (or uninitialised). Seen here: a fleet verifying an
adapter on two replicas at once (each replica's reference of base + adapter
loaded in its own thread), after which ``make_checkpoint(tie_word_embeddings=
True)`` found its head untied. RolloutCore builds every model (``from_pretrained``,
``from_config``, PEFT's ``from_pretrained``/``get_peft_model``, a model class
called on a config) under ``HF_LOCK``; a caller that loads models in its own
threads beside RolloutCore's should take it too.
"""

from __future__ import annotations

import threading

__all__ = ["HF_LOCK"]

#: Held while a Hugging Face or PEFT model is built (re-entrant: a load may build another).
HF_LOCK = threading.RLock()
