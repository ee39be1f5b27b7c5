"""Stand-ins for what an older vLLM lacks, used by RolloutCore against that vLLM.

``vllm026``: vLLM 0.26 has the worker half of the ``nccl`` backend but no
trainer engine in ``WeightTransferTrainerFactory`` and a sync client whose
finish carries no version. ``param_checksums``: with no ``weight_version``
and no ``/weight_checker`` there, the paused validation's evidence is the
workers' block checksum of every parameter, read through a worker extension.
``reload``: the other direction, vLLM 0.34's ``start_reload`` / ``finish_reload``
(and its direct mode, refused) beside 0.26-0.33's layerwise pair; the worker
halves of the gloo and CUDA IPC backends open and close every round through it.
Each module imports vLLM only where it calls it.
"""

__all__: list[str] = []
