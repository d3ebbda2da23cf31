"""Thin Trainer callbacks: they forward Trainer events to the method schedulers, nothing more.

``SpIELCallback`` works with ``transformers.Trainer`` and TRL's ``SFTTrainer`` (any gradient
accumulation): the scheduler advances on ``on_step_end``, the event the Trainer fires once per
optimizer step (including a short last step of an epoch), never by counting backward passes.
Reselection statistics go into the Trainer's logs (``spiel/*``, in ``state.log_history`` and the
console); the scheduler's state is saved in every checkpoint folder and restored on resume.
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

from .methods.spiel import SpIELScheduler


class SpIELCallback(TrainerCallback):
    def __init__(self):
        self.scheduler: SpIELScheduler | None = None
        self._pending_logs: dict = {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.scheduler = SpIELScheduler(model, optimizer, total_steps=state.max_steps)
        if state.global_step > 0:  # resuming: the Trainer restored global_step from the checkpoint
            self.scheduler.load(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    def on_step_end(self, args, state, control, **kwargs):
        stats = self.scheduler.step()
        if stats:
            self._pending_logs.update(stats)
            control.should_log = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending_logs and logs is not None:
            logs.update(self._pending_logs)
            if state.log_history:
                state.log_history[-1].update(self._pending_logs)
            self._pending_logs = {}

    def on_save(self, args, state, control, **kwargs):
        if self.scheduler is not None and state.is_world_process_zero:
            self.scheduler.save(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    def on_train_end(self, args, state, control, **kwargs):
        if self.scheduler is not None:
            self.scheduler.close()
