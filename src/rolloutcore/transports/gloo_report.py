"""The engine workers' own answer to "what did your last gloo round write?" (issue 30).

Through the gateway, the trainer is not the one to trust with the ranks'
reports: it receives them over the transfer's group and could send anything
on. So each worker of ``rolloutcore_gloo`` also keeps its last round's
``RankReport`` (with the round's nonce), and this worker extension hands it
to whoever asks the engine itself: the gateway, through vLLM's
``/collective_rpc`` (one result per worker, in worker order). Loaded by
``--worker-extension-cls WORKER_EXTENSION`` (``ManagedEngine`` adds it to a
tensor-parallel gloo engine); an extension of one's own can subclass it.

Importable without vLLM: vLLM imports the class by name in every worker.
"""

from __future__ import annotations

from typing import Any

__all__ = ["METHOD", "WORKER_EXTENSION", "RankReportExtension"]

#: The worker method the gateway calls (``/collective_rpc``).
METHOD = "rc_gloo_rank_report"
WORKER_EXTENSION = "rolloutcore.transports.gloo_report.RankReportExtension"


class RankReportExtension:
    """Worker methods for ``/collective_rpc`` (``self`` is vLLM's worker)."""

    def rc_gloo_rank_report(self) -> dict[str, Any]:
        """``{"worker_rank", "report"}``: the last finished round's report of this worker
        (``RankReport.to_dict()``), ``None`` with a ``reason`` when it has none."""
        pc = getattr(getattr(self, "parallel_config", None), "rank", None)
        rank = getattr(self, "rank", pc)
        eng = getattr(self, "weight_transfer_engine", None)
        rep = getattr(eng, "last_report", None)
        if eng is None:
            return {"worker_rank": rank, "report": None,
                    "reason": "no weight transfer engine on this worker"}
        if rep is None:
            return {"worker_rank": rank, "report": None,
                    "reason": "no gloo round with a rank report has finished on this worker"}
        return {"worker_rank": rank, "report": rep.to_dict()}
