"""The trainers' orbax checkpoints of {"params", "opt_state"}: the step is the directory name.

Resuming takes the newest checkpoint that restores. Only committed step directories
(orbax's commit_success.txt present) are candidates; each one that fails to restore is
reported in one line (which step, what failed) and the next older one is tried. A
directory that is not committed, or that failed, is moved to WORKDIR/checkpoints_set_aside
(never deleted) so that the run can save that step again. When none restores the run
stops with one message (orbax's own log noise about the failure is silenced).
"""

from __future__ import annotations

import gc
import logging
import pathlib
import shutil
import sys
import time
from typing import Any, Callable

import jax

COMMIT_MARKER = "commit_success.txt"


class Checkpoints:
    """orbax-checkpoint manager for {"params", "opt_state"} under `directory`."""

    def __init__(self, directory: pathlib.Path, keep: int):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = directory.absolute()
        self.aside = self.directory.parent / "checkpoints_set_aside"
        self._report = print
        for step in self._step_dirs():
            if not (self.directory / str(step) / COMMIT_MARKER).exists():
                self._set_aside(step, "not committed (its writer stopped before the end)")
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def _step_dirs(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted((int(p.name) for p in self.directory.iterdir()
                       if p.is_dir() and p.name.isdigit()), reverse=True)

    def _set_aside(self, step: int, why: str) -> None:
        self.aside.mkdir(parents=True, exist_ok=True)
        target = self.aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        shutil.move(str(self.directory / str(step)), str(target))
        self._report(f"checkpoint step {step}: {why}; moved to {target}")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, target: Any, report: Callable[[str], None]) -> tuple[int, Any]:
        """(step, state) from the newest checkpoint that restores, or (0, target) if none exists.

        Raises TrainerError (examples.common.trainer) when checkpoints exist but none restores.
        """
        from examples.common.trainer import TrainerError

        self._report = report
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)
        failures = []
        for step in self._step_dirs():
            try:
                with _quiet_orbax():
                    state = self.manager.restore(step, args=self._ocp.args.StandardRestore(
                        abstract))
            except Exception as error:  # noqa: BLE001  (any damage: TensorStore, JSON, shapes)
                line = _first_line(error)
                failures.append((step, line))
                report(f"checkpoint step {step} could not be restored ({line}); trying the "
                       "next older one")
                continue
            for bad_step, _ in failures:
                self._set_aside(bad_step, "could not be restored")
            if failures:
                self.manager.reload()
            report(f"resumed from {self.directory} at step {step}")
            return step, state
        if failures:
            listing = "; ".join(f"step {s}: {why}" for s, why in failures)
            raise TrainerError(
                f"workdir: no checkpoint in {self.directory} restores ({listing}). If they were "
                "written with another config (a different model size or framework), resume "
                "with that config; otherwise the files are damaged: use a fresh --workdir.")
        return 0, target

    def save(self, step: int, state) -> None:
        self.manager.save(step, args=self._ocp.args.StandardSave(state), force=True)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


class _quiet_orbax:
    """Silences orbax's and asyncio's loggers while a restore that may fail runs, and the
    "Event loop is closed" errors that its abandoned futures raise when collected."""

    _NAMES = ("absl", "asyncio", "orbax", "jax._src.distributed")

    def __enter__(self):
        self._levels = {}
        for name in self._NAMES:
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            logger.setLevel(logging.CRITICAL)
        self._hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def _unraisable(self, unraisable) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and "Event loop is closed" in str(unraisable.exc_value)):
            self._hook(unraisable)

    def __exit__(self, *exc):
        gc.collect()   # the failed restore's futures are collected here, under the hook
        sys.unraisablehook = self._hook
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
