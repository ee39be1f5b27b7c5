"""Wiring of the subcommands owned by other modules into the ``rolloutcore`` CLI.

Each owner module exposes ``add_<name>_parser(subparsers)``; this list is the
only place that knows them. The owners import torch/vLLM inside their
command functions, not at import time, so ``rolloutcore --help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["PARSERS"]


def _model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rolloutcore.testing.models import add_model_parser

    add_model_parser(sub)


def _live(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rolloutcore.cli.live import add_live_parser

    add_live_parser(sub)


def _train(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rolloutcore.cli.train import add_train_parser

    add_train_parser(sub)


def _audit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rolloutcore.provenance.audit import add_audit_parser

    add_audit_parser(sub)


def _replay(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rolloutcore.provenance.replay import add_replay_parser

    add_replay_parser(sub)


def _serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from rolloutcore.service.serve import add_serve_parser

    add_serve_parser(sub)


PARSERS: list[Callable[[Any], None]] = [_model, _train, _live, _audit, _replay, _serve]
