"""A vLLM worker extension that breaks one rank's share of a gloo update (tests only).

The negative controls of a tensor-parallel update need a rank that writes
the wrong thing while every endpoint succeeds. Loaded through
``--worker-extension-cls rankfault.RankFault`` (this directory on
``PYTHONPATH``); importing the module in each worker wraps the real
``GlooWeightTransferEngine``. What it does is read, at every round, from
the file named by ``ROLLOUTCORE_TEST_RANK_FAULT`` (empty or absent: nothing):

    skip <tp rank> <tensor>    that rank does not load <tensor>
    other <tp rank> <tensor>   that rank loads <tensor> with the other rank's
                               slice where its own belongs
    die <tp rank> <tensor>     that rank SIGKILLs itself when <tensor> arrives
    slow <tp rank> <seconds>   that rank waits before joining the trainer's group
    disown <pp rank> <tensor>  that pipeline stage takes <tensor> for another stage's
                               (skips it and reports it skipped, as for a layer it
                               does not hold)

The engine and the transfer are otherwise the real ones.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import rolloutcore.transports.gloo as gloo
from rolloutcore.transports.gloo_report import RankReportExtension

ENV = "ROLLOUTCORE_TEST_RANK_FAULT"


def fault_env(fault: Any, *paths: str) -> dict[str, str]:
    """An engine's environment for this extension: this directory (then ``paths``, then
    the caller's own) on ``PYTHONPATH``, and the fault file at ``fault``."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, *paths, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, ENV: str(fault)}


def _fault() -> tuple[str, int, str] | None:
    path = os.environ.get(ENV)
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        words = f.read().split()
    if len(words) != 3:
        return None
    return words[0], int(words[1]), words[2]


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _pp_rank() -> int:
    from vllm.distributed import get_pp_group

    return int(get_pp_group().rank_in_group)


def _other_slice(name: str, w: Any) -> Any:
    import torch

    dim = 1 if name.endswith(("down_proj.weight", "o_proj.weight")) else 0
    half = w.shape[dim] // 2
    first = w.narrow(dim, 0, half)
    return torch.cat([first, first], dim=dim)  # rank 1 finds rank 0's slice in its place


def _install() -> None:
    cls = gloo.GlooWeightTransferEngine
    receive, init = cls.receive_weights, cls.init_transfer_engine

    def receive_weights(self: Any, info: Any) -> None:
        f = _fault()
        if f is not None and f[0] == "disown":
            if f[1] != _pp_rank() or self._index is None:
                return receive(self, info)
            index, target = self._index, f[2]
            real_elsewhere = index.owned_elsewhere
            index.owned_elsewhere = lambda name: name == target or real_elsewhere(name)
            try:
                return receive(self, info)
            finally:
                del index.owned_elsewhere
        if f is None or f[0] == "slow" or f[1] != _tp_rank():
            return receive(self, info)
        kind, _, target = f
        model = self.model
        real = model.load_weights

        def load_weights(weights: Any) -> Any:
            out = []
            for name, w in weights:
                if name == target:
                    if kind == "skip":
                        continue
                    if kind == "die":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if kind == "other":
                        w = _other_slice(name, w)
                out.append((name, w))
            return real(out)

        model.load_weights = load_weights
        try:
            return receive(self, info)
        finally:
            del model.load_weights

    def init_transfer_engine(self: Any, init_info: Any) -> None:
        f = _fault()
        if f is not None and f[0] == "slow" and f[1] == _tp_rank():
            time.sleep(float(f[2]))
        return init(self, init_info)

    cls.receive_weights = receive_weights
    cls.init_transfer_engine = init_transfer_engine


class RankFault(RankReportExtension):
    """Importing its module installs the fault hooks; its methods are the workers' own
    reports of a round (``gloo_report``), as on an engine without the faults."""


_install()
