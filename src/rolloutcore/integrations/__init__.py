"""Adapters from training frameworks to RolloutCore (optional extras).

``rolloutcore.integrations.trl``: TRL's ``GRPOTrainer`` generating through
RolloutCore (``pip install 'rolloutcore[trl]'``). Each integration imports
its framework lazily, so this package imports without any of them.
"""

__all__: list[str] = []
