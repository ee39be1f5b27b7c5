"""Every parameter's block checksum, worker against trainer: evidence without a label.

vLLM 0.26 has no ``weight_version`` and no ``/weight_checker``. What an NCCL
update installed is then checked, while the engine is paused, by the block
checksum (``cuda_ipc.checksum``: exact integer arithmetic on the GPU) of
every model parameter, on both sides:

* the workers hash their parameters (``ParamChecksumExtension``, mixed into
  vLLM's worker by ``--worker-extension-cls WORKER_EXTENSION`` and called
  through ``/collective_rpc``);
* the trainer hashes the same bytes *in vLLM's layout* (``engine_layout_views``:
  fused ``qkv_proj`` / ``gate_up_proj`` as the concatenation of their parts,
  tensor parallelism 1), taken at staging while the engine still serves;
* ``ParamChecksumValidator`` compares the two with the one comparison
  (``verification.checksums.compare_lists``) and answers the adapter's
  transport-check hook with a ``Check`` at ``ENGINE_CHECKSUM`` level. It
  fails closed: nothing staged, a parameter with no known source, another
  parameter order, or one differing value fails it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput, EngineUnavailable
from rolloutcore.verification.checksums import compare_lists

__all__ = [
    "FUSIONS",
    "METHOD",
    "WORKER_EXTENSION",
    "ParamChecksumExtension",
    "ParamChecksumValidator",
    "compare_param_checksums",
    "engine_layout_views",
    "engine_param_sources",
]

#: The worker-extension method (``/collective_rpc``) that returns the checksums.
METHOD = "rc_nccl_param_checksums"
WORKER_EXTENSION = "rolloutcore.transports.compat.param_checksums.ParamChecksumExtension"

#: vLLM fuses these HF tensors into one parameter (concatenated along dim 0, TP=1).
FUSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".self_attn.qkv_proj.weight", (".self_attn.q_proj.weight", ".self_attn.k_proj.weight",
                                    ".self_attn.v_proj.weight")),
    (".mlp.gate_up_proj.weight", (".mlp.gate_proj.weight", ".mlp.up_proj.weight")),
)


class ParamChecksumExtension:
    """Worker methods for ``/collective_rpc`` (``--worker-extension-cls``).

    ``self`` is vLLM's worker; the model is its weight transfer engine's
    target when there is one, else the model runner's.
    """

    def _rc_model(self) -> Any:
        eng = getattr(self, "weight_transfer_engine", None)
        model = getattr(eng, "model", None)
        if model is None:
            model = self.model_runner.model  # type: ignore[attr-defined]
        return model

    def rc_nccl_param_checksums(self) -> dict[str, Any]:
        """Names, block checksums and byte sizes of every parameter, in module order."""
        import torch

        from rolloutcore.transports.cuda_ipc.checksum import block_checksum

        named = list(self._rc_model().named_parameters())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.monotonic()
        vals = block_checksum([p.data for _, p in named])
        return {"names": [n for n, _ in named], "values": vals,
                "nbytes": [p.numel() * p.element_size() for _, p in named],
                "elapsed_s": time.monotonic() - t}


def engine_param_sources(engine_names: Sequence[str],
                         trainer_names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """For each engine parameter, the trainer tensors whose bytes it holds, in order.

    Parameters with no source (unknown fusion, missing tensor) are absent.
    """
    have = set(trainer_names)
    out: dict[str, tuple[str, ...]] = {}
    for name in engine_names:
        if name in have:
            out[name] = (name,)
            continue
        for fused, parts in FUSIONS:
            if name.endswith(fused):
                stem = name[: -len(fused)]
                srcs = tuple(stem + p for p in parts)
                if all(s in have for s in srcs):
                    out[name] = srcs
                break
    return out


def engine_layout_views(packed: Any, names: Sequence[str], nbytes: Sequence[int]
                        ) -> tuple[list[Any], list[bool]]:
    """Byte views of a ``PackedWeights``' tensors in the engine's parameter order.

    A fused parameter is one contiguous slice of the buffer when its parts
    are adjacent there, else a concatenated copy. Where no source is known,
    or the sizes disagree, zeros of the right size and ``covered`` False.
    """
    import torch

    entries = {e.name: e for e in packed.entries}
    srcs = engine_param_sources(names, entries)
    buf = packed.buffer
    views: list[Any] = []
    covered: list[bool] = []
    for name, nb in zip(names, nbytes, strict=True):
        parts = srcs.get(name)
        es = [entries[p] for p in parts] if parts is not None else []
        if not es or sum(e.nbytes for e in es) != nb:
            views.append(torch.zeros(nb, dtype=torch.uint8, device=buf.device))
            covered.append(False)
            continue
        adjacent = all(b.offset_bytes == a.offset_bytes + a.nbytes
                       for a, b in itertools.pairwise(es))
        if adjacent:
            views.append(buf[es[0].offset_bytes:es[0].offset_bytes + nb])
        else:
            views.append(torch.cat([buf[e.offset_bytes:e.offset_bytes + e.nbytes] for e in es]))
        covered.append(True)
    return views, covered


def compare_param_checksums(want_names: Sequence[str], want: Sequence[int | None],
                            got_names: Sequence[str], got: Sequence[int | None]
                            ) -> dict[str, Any]:
    """The trainer's checksums (``want``; ``None``: not covered) against the workers'.

    Passes only with the same parameters in the same order, every one covered
    and equal (a block checksum depends on position, so order matters). A
    dict, as the harnesses record it.
    """
    r = compare_lists(got_names, got, want_names, want)
    return {"same_layout": not r.layout_mismatch, "compared": r.compared,
            "params": r.engine_params, "coverage": r.coverage,
            "n_mismatched": len(r.mismatched), "mismatched": list(r.mismatched[:20]),
            "passed": r.complete}


#: ``rpc(method, timeout_s)`` -> (one result per worker, seconds the call took)
Rpc = Callable[[str, float], tuple[list[Any], float]]
#: ``views(names, nbytes)`` -> (byte views in the engine's layout, covered flags)
Views = Callable[[Sequence[str], Sequence[int]], tuple[list[Any], list[bool]]]


class ParamChecksumValidator:
    """The workers' parameter checksums against the trainer's, as a paused-validation ``Check``.

    ``learn_layout`` once (names and sizes of the engine's parameters), then
    per update: ``stage`` (the trainer's checksums, before the pause) and
    ``validation_check(base_url)``, the transport hook ``VllmAdapter.validate``
    calls. One worker (tensor parallelism 1): the layout views assume it.
    """

    def __init__(self, rpc: Rpc, views: Views | None = None, *,
                 timeout_s: float = 60.0) -> None:
        self.rpc = rpc
        self.views = views
        self.timeout_s = timeout_s
        self.names: list[str] = []
        self.nbytes: list[int] = []
        self.expected: list[int | None] | None = None
        self.last: dict[str, Any] = {}

    def engine_params(self) -> dict[str, Any]:
        res, dt = self.rpc(METHOD, self.timeout_s)
        if not isinstance(res, list) or len(res) != 1 or not isinstance(res[0], Mapping):
            raise EngineUnavailable("validate", f"{METHOD}: unexpected answer {str(res)[:300]}",
                                    mutation_started=True)
        return {**res[0], "rpc_s": dt}

    def learn_layout(self) -> dict[str, Any]:
        got = self.engine_params()
        self.names, self.nbytes = list(got["names"]), [int(x) for x in got["nbytes"]]
        return got

    def stage(self) -> float:
        """The trainer's checksums of what it will send, in the engine's layout (taken at
        staging, while the engine still serves). Returns the seconds it took."""
        from rolloutcore.transports.cuda_ipc.checksum import block_checksum

        if self.views is None or not self.names:
            raise BadInput("stage needs the trainer's views and the engine's layout "
                           "(learn_layout first)")
        t = time.monotonic()
        views, covered = self.views(self.names, self.nbytes)
        vals = block_checksum(views)
        self.expected = [v if c else None for v, c in zip(vals, covered, strict=True)]
        return time.monotonic() - t

    def compare(self) -> dict[str, Any]:
        got = self.engine_params()
        if self.expected is None:
            return {"passed": False, "detail": "no trainer checksum staged", "engine": got}
        cmp = compare_param_checksums(self.names, self.expected, got["names"], got["values"])
        cmp.update(engine_s=got.get("elapsed_s"), rpc_s=got.get("rpc_s"))
        self.last = cmp
        return cmp

    def validation_check(self, base_url: str) -> Check:
        cmp = self.compare()
        detail = (f"worker block checksums of {cmp.get('params')} parameters vs the trainer's "
                  f"of the same bytes in vLLM's layout; compared={cmp.get('compared')} "
                  f"mismatched={cmp.get('n_mismatched')} same_layout={cmp.get('same_layout')}")
        if cmp.get("mismatched"):
            detail += f" first: {cmp['mismatched'][:3]}"
        return Check("worker_param_block_checksum", bool(cmp["passed"]), detail=detail,
                     coverage=float(cmp.get("coverage", 0.0)),
                     level=VerificationLevel.ENGINE_CHECKSUM)
