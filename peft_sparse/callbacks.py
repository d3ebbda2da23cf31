"""Thin Trainer callbacks: they forward Trainer events to the method schedulers, nothing more.

``SpIELCallback`` works with ``transformers.Trainer`` and TRL's ``SFTTrainer`` (any gradient
accumulation): the scheduler advances on ``on_step_end``, the event the Trainer fires once per
optimizer step (including a short last step of an epoch), never by counting backward passes.
Reselection statistics go into the Trainer's logs (``spiel/*``, in ``state.log_history`` and the
console); the scheduler's state is saved in every checkpoint folder and restored on resume — from the
checkpoint the Trainer resumes from, wherever it lies: each checkpoint's ``trainer_state.json`` names
the scheduler state saved with it (a token, also written beside that state, and the folder it went to).
"""

from __future__ import annotations

import json
import os
import uuid

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .methods.lt_sft import LTSFTConfig, LTSFTScheduler
from .methods.spiel import SpIELConfig, SpIELScheduler
from .schedules.slow_fast import SlowFastConfig, SlowFastScheduler

def _replicate_if_sharded(model) -> None:
    """Under FSDP2 (accelerate's ``fsdp_version: 2``) the values stay replicated: see :mod:`peft_sparse.distributed`."""
    import torch.distributed as dist

    if model is not None and dist.is_available() and dist.is_initialized():
        from .distributed import is_fsdp2, replicate_values

        if is_fsdp2(model):
            replicate_values(model)


class _CheckpointedScheduler(ExportableState):
    """A callback whose scheduler state is saved into every checkpoint folder and found again on resume: the
    Trainer writes :meth:`state` (a fresh token and the folder) into the checkpoint's ``trainer_state.json``
    right before ``on_save``, which writes the same token beside the scheduler's files."""

    token_file = ""  # (set by each callback)

    def _init_checkpointing(self) -> None:
        self._output_dir: str | None = None
        self._step = 0
        self.checkpoint_token: str | None = None
        self.checkpoint_dir: str | None = None

    def state(self) -> dict:
        if self._output_dir is not None:
            self.checkpoint_token = uuid.uuid4().hex
            self.checkpoint_dir = os.path.abspath(os.path.join(self._output_dir, f"checkpoint-{self._step}"))
        return {"args": {}, "attributes": {"checkpoint_token": self.checkpoint_token, "checkpoint_dir": self.checkpoint_dir}}

    def _token_in(self, directory: str):
        try:
            with open(os.path.join(directory, self.token_file)) as f:
                return json.load(f).get("token")
        except (OSError, ValueError):
            return None

    def _write_token(self, directory: str, global_step: int) -> None:
        with open(os.path.join(directory, self.token_file), "w") as f:
            json.dump({"token": self.checkpoint_token, "global_step": global_step}, f)

    def _resumed_state_dir(self, args, state) -> str:
        """The folder holding the scheduler state saved with the checkpoint the Trainer resumed from: the
        one its ``trainer_state.json`` names (by token; first where the Trainer would put it, then where
        it was written). Checkpoints written without a token: the output folder's."""
        usual = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        saved = saved[0] if isinstance(saved, list) and saved else saved
        attributes = saved.get("attributes", {}) if isinstance(saved, dict) else {}
        token, written = attributes.get("checkpoint_token"), attributes.get("checkpoint_dir")
        if token is None:
            return usual
        candidates = [usual] + ([written] if written else [])
        for directory in candidates:
            if self._token_in(directory) == token:
                return directory
        raise FileNotFoundError(
            f"{type(self).__name__}: the scheduler state saved with the checkpoint being resumed (step {state.global_step}) "
            f"is in none of {candidates}: copy that checkpoint's scheduler files and {self.token_file} into the "
            "folder resumed from, or resume from the original checkpoint folder"
        )


class _PendingLogs(TrainerCallback):
    """Adds what a callback gathered at an optimizer step (``_pending_logs``) to the next log entry."""

    _pending_logs: dict

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending_logs and logs is not None:
            logs.update(self._pending_logs)
            if state.log_history:
                state.log_history[-1].update(self._pending_logs)
            self._pending_logs = {}


class SpIELCallback(_PendingLogs, _CheckpointedScheduler):
    token_file = "spiel_checkpoint.json"

    def __init__(self):
        self.scheduler: SpIELScheduler | None = None
        self._pending_logs: dict = {}
        self._init_checkpointing()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._output_dir, self._step = args.output_dir, state.global_step
        _replicate_if_sharded(model)
        self.scheduler = SpIELScheduler(model, optimizer, total_steps=state.max_steps)
        if state.global_step > 0:  # resuming: the Trainer restored global_step (and its state) from the checkpoint
            self.scheduler.load(self._resumed_state_dir(args, state))

    def on_step_end(self, args, state, control, **kwargs):
        self._step = state.global_step
        stats = self.scheduler.step()
        if stats:
            self._pending_logs.update(stats)
            control.should_log = True

    def on_save(self, args, state, control, **kwargs):
        if self.scheduler is not None and state.is_world_process_zero:
            directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self.scheduler.save(directory)
            self._write_token(directory, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.scheduler is not None:
            self.scheduler.close()


def callbacks_for(peft_config) -> list:
    """The Trainer callbacks a method's config needs (a recipe adds them on its own)."""
    out = []
    if isinstance(peft_config, SpIELConfig):
        out.append(SpIELCallback())
    if isinstance(peft_config, LTSFTConfig):
        out.append(LTSFTCallback())
    if getattr(peft_config, "slow_fast", None) is not None:
        out.append(SlowFastCallback())
    return out


class LTSFTCallback(_PendingLogs, _CheckpointedScheduler):
    """Drives :class:`peft_sparse.LTSFTScheduler` from Trainer events: the L1 gradient before every optimizer
    step, the switch to the sparse phase after ``dense_steps`` (the Trainer's optimizer is re-pointed at the
    selected values in place), and ``lt_sft/l1`` and ``lt_sft/phase`` in the logs. Run the Trainer for
    ``dense_steps + sparse_steps`` steps.

    Checkpoints hold the scheduler's state (its step, and in the dense phase the heads' starting values the
    switch rewinds to), and ``trainer.train(resume_from_checkpoint=...)`` continues from them. A checkpoint of
    the dense phase resumes into the model built as before; one of the sparse phase holds the selected adapter,
    so build the model from it: ``PeftModel.from_pretrained(base, checkpoint, is_trainable=True)``."""

    token_file = "lt_sft_checkpoint.json"
    state_file = "lt_sft_scheduler.json"
    heads_file = "lt_sft_heads.safetensors"

    def __init__(self, adapter_name=None):
        self.adapter_name = adapter_name  # (None: the one active LT-SFT adapter)
        self.scheduler = None
        self._pending_logs: dict = {}
        self._init_checkpointing()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._output_dir, self._step = args.output_dir, state.global_step
        self.scheduler = LTSFTScheduler(model, adapter_name=self.adapter_name)
        config = self.scheduler.config
        if state.global_step > 0:
            self._resume(self._resumed_state_dir(args, state), state.global_step)
        total = config.dense_steps + config.sparse_steps
        if state.max_steps != total:
            raise ValueError(
                f"LT-SFT runs dense_steps + sparse_steps = {total} optimizer steps; "
                f"the Trainer will run max_steps={state.max_steps}: set TrainingArguments(max_steps=...) to match"
            )
        self.scheduler.attach(optimizer, lr_scheduler)

    def _resume(self, directory: str, global_step: int) -> None:
        path = os.path.join(directory, self.state_file)
        if not os.path.exists(path):
            raise FileNotFoundError(f"LTSFTCallback: resuming at step {global_step} but {path} is missing (a checkpoint written without LTSFTCallback?)")
        with open(path) as f:
            saved = json.load(f)
        if saved["phase"] != self.scheduler.phase:
            raise ValueError(
                f"LTSFTCallback: the checkpoint at step {global_step} is in the {saved['phase']!r} phase but the model's LT-SFT "
                f"adapter is in the {self.scheduler.phase!r} phase: build the model from the checkpoint, "
                f"PeftModel.from_pretrained(base, {directory!r}, is_trainable=True), and resume with it"
            )
        self.scheduler.load_state_dict(saved)
        if saved["phase"] == "dense":
            from safetensors.torch import load_file

            from .core.storage import reading

            heads_path = os.path.join(directory, self.heads_file)
            with reading(heads_path):
                flat = load_file(heads_path)
            snapshot: dict = {}
            for key, tensor in flat.items():
                head, name = key.split("::", 1)
                snapshot.setdefault(head, {})[name] = tensor
            self.scheduler.head_snapshot = {n: snapshot.get(n, {}) for n in self.scheduler.head_snapshot}

    def on_step_end(self, args, state, control, **kwargs):
        self._step = state.global_step
        switched = self.scheduler.step()
        if self.scheduler.config.l1_reg > 0:
            self._pending_logs["lt_sft/l1"] = self.scheduler.last_l1
        if switched:
            self._pending_logs["lt_sft/selected"] = sum(self.scheduler.config.tunable_weights_per_module.values())
            control.should_log = True

    def on_save(self, args, state, control, **kwargs):
        if self.scheduler is None or not state.is_world_process_zero:
            return
        directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, self.state_file), "w") as f:
            json.dump(self.scheduler.state_dict(), f)
        if self.scheduler.phase == "dense":
            from safetensors.torch import save_file

            flat = {f"{head}::{name}": t.contiguous() for head, state_ in self.scheduler.head_snapshot.items() for name, t in state_.items()}
            save_file(flat, os.path.join(directory, self.heads_file))
        self._write_token(directory, state.global_step)


class SlowFastCallback(_PendingLogs):
    """Slow-fast learning rates in a Trainer/TRL run: each optimizer step's training loss (the mean over its
    micro-batches, read from the model's outputs) goes in, the phase, φ and the multipliers per set go to
    the logs (``slow_fast/*``). The settings come from ``config`` or from the adapter config's ``slow_fast``."""

    _STATE = "slow_fast_state.json"

    def __init__(self, config=None):
        self.config = config
        self.scheduler = None
        self._losses: list = []
        self._pending_logs: dict = {}
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        config = self.config
        if config is None:
            peft_config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", None))
            config = getattr(peft_config, "slow_fast", None)
        config = SlowFastConfig.from_value(config)
        if config is None:
            raise ValueError("SlowFastCallback needs a SlowFastConfig: pass it, or set slow_fast in the sparse config")
        self.scheduler = SlowFastScheduler(model, optimizer, config, lr_scheduler=lr_scheduler)
        if state.global_step > 0:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", self._STATE)
            with open(path) as f:
                self.scheduler.load_state_dict(json.load(f))
            self.scheduler.apply()
        self._hook = model.register_forward_hook(self._capture)

    def _capture(self, module, inputs, output):
        loss = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
        if module.training and loss is not None:
            self._losses.append(float(loss.detach()))

    def on_step_end(self, args, state, control, **kwargs):
        if not self._losses:
            raise RuntimeError("SlowFastCallback saw no training loss in this step: the model's outputs carry none (pass labels)")
        loss = sum(self._losses) / len(self._losses)
        self._losses = []
        self._pending_logs = self.scheduler.step(loss)

    def on_save(self, args, state, control, **kwargs):
        if self.scheduler is not None and state.is_world_process_zero:
            directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, self._STATE), "w") as f:
                json.dump(self.scheduler.state_dict(), f)

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class S4Callback(TrainerCallback):
    """S⁴ in a ``Trainer``/``SFTTrainer``: attaches an :class:`~peft_sparse.S4Router` to the Trainer's optimizer at
    the start of training (removed at the end). Each batch must name its language: build the dataset with
    :class:`peft_sparse.data.LanguageBatchStream` and the collator with :class:`peft_sparse.data.LanguageCollator`,
    and keep the column (``remove_unused_columns=False``)."""

    def __init__(self, adapter_name: str = "default", column: str = "language"):
        self.adapter_name, self.column = adapter_name, column
        self.router = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from .methods.s4 import S4Router

        if optimizer is None:
            raise RuntimeError("S4Callback: the Trainer passed no optimizer at on_train_begin")
        self.router = S4Router(model, optimizer, adapter_name=self.adapter_name, column=self.column)

    def on_train_end(self, args, state, control, **kwargs):
        if self.router is not None:
            self.router.remove()
            self.router = None
