"""Stand-ins for what an older vLLM lacks, used by RolloutCore against that vLLM.

``vllm026``: vLLM 0.26 has the worker half of the ``nccl`` backend but no
trainer engine in ``WeightTransferTrainerFactory`` and a sync client whose
finish carries no version. ``param_checksums``: with no ``weight_version``
and no ``/weight_checker`` there, the paused validation's evidence is the
workers' block checksum of every parameter, read through a worker extension.
Nothing here is imported by the rest of the package; each module imports
vLLM only where it calls it.
"""

__all__: list[str] = []
