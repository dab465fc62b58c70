"""The training core shared by pretraining, SFT, LoRA and DPO.

Accelerate owns devices, mixed precision, gradient accumulation and DDP/FSDP; this module owns the loop:
optimizer steps over groups of `accumulation_steps` micro-batches, warmup+cosine schedule, clipping,
evaluation, atomic checkpoints with exact resume, logging (tqdm, metrics.jsonl, wandb) and the final
Hugging Face model directory. What differs between the kinds of run is confined to three places: the model
(`_build_model`; LoRA wraps it with PEFT adapters), the objective (trainer/objectives.py: language modeling, or
trainer/dpo.py's preference loss against a frozen reference model) and the data (trainer/data.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from accelerate.utils import broadcast_object_list, set_seed
from tqdm.auto import tqdm

from dataset.atomic_io import atomic_write_text
from dataset.chat_format import encode_chatml, encode_text
from model.generation_defaults import saved_generation_config
from model.model import MiniNormForCausalLM
from trainer.args import (MODEL_FIELDS, RUNTIME_MODEL_FIELDS, TrainArgs, build_model_config, compile_enabled,
                          resolve_dtype)
from trainer.checkpoint import (agree_on_resume, check_resume_compatible, load_checkpoint, probe_storage,
                                save_checkpoint, saved_position)
from trainer.data import build_run_data, data_identity, dataset_stats, shard_loader
from trainer.distributed import (check_optimizer_supported, collective_timed_out, full_state_dict, make_accelerator,
                                 set_collective_timeout, shutdown, state_is_sharded, update_inside_backward,
                                 weights_are_sharded)
from trainer.evaluation import token_byte_lengths
from trainer.flops import flops_per_token, peak_flops_for
from trainer.metrics_log import MetricsLog
from trainer.objectives import EvalResult, LanguageModeling, Objective
from trainer.optim import build_optimizer, scheduled_lrs
from trainer.run_dir import (CHECKPOINT_DIR, CONFIG_FILE, CREATE_COMMANDS, DEFAULT_FROM_WEIGHT, DEFAULT_OUT_DIRS,
                             EXIT_DIVERGED, EXIT_PEER_LOST, MERGED_DIR, SUMMARY_FILE, is_chat_task, report_error,
                             resolve_path)
from trainer.budget import TimeBudget
from trainer.schedule import build_scheduler

PRETRAIN_PROMPT, CHAT_PROMPT = "The history of", "What is the capital of France?"

StepOutcome = Literal["applied", "skipped", "diverged"]


def step_outcome(loss: float, grad_norm: float, scaler_skipped: bool | None) -> StepOutcome:
    """What one optimizer step amounted to. `scaler_skipped`: None without an fp16 grad scaler, else whether the
    scaler skipped the update. Under fp16 an inf/NaN gradient is an overflow the scaler handles (it skips the
    update and lowers the scale), so only a non-finite loss is divergence; without a scaler either one is."""
    if not math.isfinite(loss):
        return "diverged"
    if scaler_skipped is None:
        return "applied" if math.isfinite(grad_norm) else "diverged"
    return "skipped" if scaler_skipped else "applied"


class TrainingDiverged(RuntimeError):
    """The loss (or, without fp16 loss scaling, the gradient) became NaN/inf; the last good state was saved."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"training diverged at optimizer step {step} (non-finite loss or gradient); "
                         f"the last good state is saved in {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


@dataclass
class RunSummary:
    status: str                    # "finished" or "diverged"
    out_dir: str
    steps: int
    tokens_seen: int
    num_params: int
    final_val: dict[str, float] = field(default_factory=dict)
    median_step_time_s: float = float("nan")
    tokens_per_s: float = float("nan")
    mfu: float = float("nan")
    wall_time_s: float = float("nan")
    sample: str = ""


def _load_tokenizer(args: TrainArgs):
    from dataset.tokenization import load_tokenizer
    return load_tokenizer(resolve_path(args.tokenizer_path) if args.tokenizer_path else None)


def _starting_weights(args: TrainArgs) -> Path:
    """The model directory a fine-tuning run starts from: --from_weight, else its task's default."""
    source_task = DEFAULT_FROM_WEIGHT[args.task]
    source = resolve_path(args.from_weight or DEFAULT_OUT_DIRS[source_task])
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"--from_weight {source}: no model to start from there; create it with "
                                f"`{CREATE_COMMANDS[source_task]}` (or pass --from_weight DIR)")
    return source


def _build_model(args: TrainArgs, tokenizer) -> MiniNormForCausalLM:
    """A fresh model (pretraining) or the starting weights (every fine-tuning run), before any wrapping."""
    if args.task == "pretrain":
        config = build_model_config(args, vocab_size=len(tokenizer))
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        return MiniNormForCausalLM(config)
    source = _starting_weights(args)
    fixed = sorted(set(args.model) - set(RUNTIME_MODEL_FIELDS))
    if fixed:
        raise ValueError(f"--{fixed[0]} cannot change when fine-tuning a pretrained model (--from_weight); only "
                         f"{', '.join('--' + f for f in RUNTIME_MODEL_FIELDS)} may be set")
    return MiniNormForCausalLM.from_pretrained(source, **args.model)


def _effective_config(args: TrainArgs, model: MiniNormForCausalLM) -> dict[str, Any]:
    config = {k: v for k, v in args.to_dict().items() if k != "model"}
    config.update({name: getattr(model.config, name) for name in MODEL_FIELDS})
    config["out_dir"] = str(args.resolved_out_dir())
    return config


def _sample_text(model: MiniNormForCausalLM, tokenizer, args: TrainArgs) -> str:
    chat = is_chat_task(args.task)
    prompt = args.sample_prompt or (CHAT_PROMPT if chat else PRETRAIN_PROMPT)
    # The prompt is text, whatever it contains (a --sample_prompt with "<|im_end|>" in it stays text).
    ids = (encode_chatml(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True).input_ids
           if chat else encode_text(tokenizer, prompt))
    input_ids = torch.tensor([ids], device=next(model.parameters()).device)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    was_training = model.training
    model.eval()  # no dropout while sampling
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        output = model.generate(**inputs, max_new_tokens=48, do_sample=True, temperature=0.7, top_p=0.9,
                                repetition_penalty=1.1)
    model.train(was_training)
    completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return f"{prompt} -> {completion.strip()}" if chat else prompt + completion


def make_optimizer(model: torch.nn.Module, args: TrainArgs, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer the flags ask for (trainer/optim.py builds it). An fp32 run on a CPU orthogonalizes Muon's
    updates in fp32: `--dtype auto` picks fp32 exactly where the CPU's bf16 products are emulated."""
    return build_optimizer(model, args.learning_rate, args.weight_decay, args.optimizer, muon_lr=args.muon_lr,
                           muon_weight_decay=args.muon_weight_decay, muon_momentum=args.muon_momentum,
                           muon_adjust_lr=args.muon_adjust_lr,
                           orthogonalize_in_fp32=device.type == "cpu" and args.dtype == "float32")


def make_scheduler(optimizer: torch.optim.Optimizer, args: TrainArgs,
                   total_steps: int | Callable[[], int]) -> torch.optim.lr_scheduler.LRScheduler:
    """The flags' schedule over `total_steps` optimizer steps (trainer/schedule.py)."""
    return build_scheduler(optimizer, args.warmup_steps, total_steps, args.min_lr_ratio, args.lr_schedule,
                           args.decay_fraction)


def save_model_dir(model: torch.nn.Module, tokenizer, out_dir: Path) -> None:
    """Write a plain HF model directory (a PEFT adapter directory for a PEFT model); each file is moved into place
    whole."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    base.generation_config = saved_generation_config(tokenizer.eos_token_id, tokenizer.pad_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".model_", dir=out_dir))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        for item in staging.iterdir():
            os.replace(item, out_dir / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class Trainer:
    """One training run. `run()` returns its summary; `TrainingDiverged` if the loss blows up."""

    def __init__(self, args: TrainArgs) -> None:
        args.dtype = resolve_dtype(args.dtype)
        self.args = args
        self.out_dir = args.resolved_out_dir()
        self.accelerator = make_accelerator(args.dtype, args.accumulation_steps, args.use_wandb,
                                            timeout_s=args.dist_init_timeout)
        self.is_main = self.accelerator.is_main_process
        self.world = self.accelerator.num_processes
        self.sharded = weights_are_sharded(self.accelerator)
        self.started = time.perf_counter()
        self.wandb_run_id: str | None = None
        # One --out_dir seen by every process, or one per machine (then each machine keeps a whole checkpoint).
        self.shared_storage = probe_storage(self.accelerator, self.out_dir,
                                            node_local_allowed=not state_is_sharded(self.accelerator))
        explicit = resolve_path(args.resume) if args.resume and args.resume != "auto" else None
        self.resume = agree_on_resume(self.accelerator, args.resume, self.out_dir / CHECKPOINT_DIR, explicit)
        self.resume_from = self.resume.path if self.resume is not None else None
        self.resume_state = self.resume.state if self.resume is not None else None
        if args.use_wandb:
            self.wandb_run_id = (self.resume_state or {}).get("wandb_run_id")
            init = {"name": args.wandb_run_name, "group": args.wandb_group, "dir": str(self.out_dir),
                    "id": self.wandb_run_id, "resume": "allow" if self.wandb_run_id else None}
            if self.is_main:
                self.out_dir.mkdir(parents=True, exist_ok=True)
            self.accelerator.init_trackers(args.wandb_project, config=args.to_dict(), init_kwargs={"wandb": init})
            if self.is_main:
                self.wandb_run_id = self.accelerator.get_tracker("wandb", unwrap=True).id
        set_seed(args.seed)
        self.tokenizer = _load_tokenizer(args)
        with self.accelerator.main_process_first():
            self.data = build_run_data(args, self.tokenizer, quiet=not self.is_main)
        self.data_identity = data_identity(self.data)
        if self.resume_state is not None:
            check_resume_compatible(self.resume_from, self.resume_state, args, self.data_identity)
        set_seed(args.seed)  # the same initial weights whatever the data building consumed
        base = _build_model(args, self.tokenizer)
        if args.max_seq_len > base.config.max_position_embeddings:
            raise ValueError(f"--max_seq_len={args.max_seq_len} exceeds the model's max_position_embeddings="
                             f"{base.config.max_position_embeddings}")
        if args.gradient_checkpointing:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.config_dict = _effective_config(args, base)
        self.model = self._wrap_for_task(base)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.trainable_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        check_optimizer_supported(self.accelerator, args.optimizer)
        self.optimizer = make_optimizer(self.model, args, self.accelerator.device)
        (self.model, self.optimizer, self.train_loader) = self.accelerator.prepare(
            self.model, self.optimizer, self.data.train_loader)
        self.unwrapped = self.accelerator.unwrap_model(self.model)
        self.base_model = base  # the MiniNormForCausalLM inside any wrapping (diagnostics, the model's shape)
        self.objective = self._objective()
        # Validation shards are padded to equal length with samples that carry no target, so that every process
        # runs the same number of forward passes (a collective under FSDP) and no sample counts twice.
        self.val_loader = shard_loader(self.data.val_loader, self.accelerator.process_index, self.world)
        # Optimizer steps per epoch: global batches in one pass over the (shuffled, sharded) training set.
        self.global_batch = args.batch_size * args.accumulation_steps * self.world
        self.steps_per_epoch = len(self.data.train) // self.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(f"one optimizer step needs {self.global_batch} samples, the training set has "
                             f"{len(self.data.train)}; lower --batch_size or --accumulation_steps")
        self.total_steps = self._total_steps()
        self.budget = self._time_budget()
        self.session_step_times: list[float] = []  # this session's optimizer steps' seconds (checkpoints sum them)
        self.train_time_before_s: float = (self.resume_state or {}).get("train_time_s", 0.0)
        self.compiled = compile_enabled(args.compile, self.total_steps, args.time_budget_s)
        if self.compiled:
            self.unwrapped.compile()  # in place: same module, same state_dict keys, so checkpoints do not care
        # The schedule reads the run's length at every step: a time budget fixes it after a few steps.
        self.scheduler = self.accelerator.prepare(make_scheduler(self.optimizer, args, lambda: self.total_steps))
        self.token_bytes = token_byte_lengths(self.tokenizer)
        self.metrics = MetricsLog(self.out_dir, enabled=self.is_main)
        self.flops_per_token = flops_per_token(self.base_model.config, self.num_params, args.max_seq_len)
        self.peak_flops = args.peak_flops or peak_flops_for(self.accelerator.device, args.dtype)
        self.diagnostics = None
        if args.diag_interval:
            from trainer.diagnostics import NormDiagnostics
            self.diagnostics = NormDiagnostics(self.base_model)

    def _wrap_for_task(self, base: MiniNormForCausalLM) -> torch.nn.Module:
        """The model the optimizer trains: the base model itself, or (LoRA) the base model frozen under PEFT
        adapters."""
        if self.args.task != "lora":
            return base
        if self.sharded:
            raise ValueError("LoRA runs on one process or under DDP; FSDP/DeepSpeed sharding is not supported for "
                             "it (the adapters are small: DDP is the setup to use)")
        from model.lora import LoraSettings, add_lora, parse_targets
        args = self.args
        return add_lora(base, LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                                           targets=parse_targets(args.lora_targets)))

    def _objective(self) -> Objective:
        """What the run minimizes: language modeling, or (DPO) the preference loss against a frozen copy of the
        starting weights, kept whole on every process (it has no gradients or optimizer state)."""
        if self.args.task != "dpo":
            return LanguageModeling()
        from trainer.dpo import DirectPreference
        reference = MiniNormForCausalLM.from_pretrained(_starting_weights(self.args), **self.args.model)
        return DirectPreference(reference.to(self.accelerator.device), self.args.beta, self.accelerator.autocast)

    def _total_steps(self) -> int:
        """--max_steps, or the optimizer steps that complete --epochs passes over the data. A run resumed with
        another global batch finishes the same number of epochs: the steps already taken, plus what is left of
        the data at the new batch size. Under --time_budget_s: the length the budget fixed (a resumed run), else
        the data's bound until the budget fixes it (trainer/budget.py)."""
        if self.args.time_budget_s > 0 and (self.resume_state or {}).get("budget_fixed"):
            return self.resume_state["total_steps"]
        if self.args.max_steps > 0 and not self.args.time_budget_s:
            return self.args.max_steps
        if self.resume_state is None:
            return self.args.epochs * self.steps_per_epoch
        epoch, samples_done = saved_position(self.resume_state)
        left_in_epoch = (len(self.data.train) - samples_done) // self.global_batch
        return self.resume_state["step"] + left_in_epoch + (self.args.epochs - epoch - 1) * self.steps_per_epoch

    def _time_budget(self) -> TimeBudget | None:
        if not self.args.time_budget_s:
            return None
        fixed = bool((self.resume_state or {}).get("budget_fixed"))
        return TimeBudget(self.args.time_budget_s, max_steps=self.total_steps, fixed=fixed)

    # ----------------------------------------------------------------- checkpoints
    def _state(self, step: int, epoch: int, samples_done: int, tokens_seen: int) -> dict[str, Any]:
        return {"step": step, "epoch": epoch, "samples_done_in_epoch": samples_done, "tokens_seen": tokens_seen,
                "total_steps": self.total_steps, "processes": self.world, "data": self.data_identity,
                "wandb_run_id": self.wandb_run_id, "config": self.config_dict,
                "train_time_s": self.train_time_before_s + sum(self.session_step_times),
                "budget_fixed": self.budget is not None and self.budget.fixed}

    def _save(self, step: int, epoch: int, samples_done: int, tokens_seen: int) -> Path:
        return save_checkpoint(self.accelerator, self.out_dir / CHECKPOINT_DIR, step,
                               self._state(step, epoch, samples_done, tokens_seen), self.args.keep_checkpoints,
                               shared_storage=self.shared_storage)

    # ----------------------------------------------------------------- logging
    def _print(self, text: str) -> None:
        if self.is_main:
            tqdm.write(text)

    def _log(self, record: dict[str, Any], to_tracker: bool = True) -> None:
        self.metrics.write(record)
        if to_tracker and self.args.use_wandb:
            # Keys go to wandb as they are ("val_loss", "diag/..."): a wandb sweep's metric is "val_loss".
            self.accelerator.log({k: v for k, v in record.items() if k not in ("step", "split")},
                                 step=record["step"])

    def evaluate(self, max_batches: int) -> EvalResult:
        """Collective: every process evaluates its shard (the same number of batches on each)."""
        return self.objective.evaluate(self.unwrapped, self.val_loader, self.accelerator, self.token_bytes,
                                       max_batches)

    # ----------------------------------------------------------------- the loop
    def _token_counts(self, batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
        """(the objective's units -- supervised targets, or preference pairs --, real input tokens) of one optimizer
        step over all processes: the loss's divisor and the step's throughput count (padding is not a token)."""
        supervised = sum(self.objective.count_items(b) for b in batches)
        real = sum(b["attention_mask"].sum() if "attention_mask" in b else b["input_ids"].numel() for b in batches)
        counts = torch.stack([torch.as_tensor(supervised), torch.as_tensor(real)]).to(self.accelerator.device)
        counts = self.accelerator.reduce(counts, reduction="sum")
        return counts[0], int(counts[1])

    def _grad_norm(self, max_norm: float) -> float | None:
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        return None if norm is None else float(norm)  # None: DeepSpeed did not report one

    def _optimizer_step(self, batches: list[dict[str, torch.Tensor]], arm_diagnostics: bool
                        ) -> tuple[StepOutcome, float, float, dict[str, float], dict[str, float], int]:
        """Forward/backward over one group of micro-batches, then one optimizer step. Returns (outcome, global
        mean loss, gradient norm before clipping, diagnostics, the objective's statistics, real tokens)."""
        accelerator, model = self.accelerator, self.model
        num_items, real_tokens = self._token_counts(batches)
        num_items = num_items.clamp(min=1)
        # Each micro-batch's loss is its token sum over the whole group's supervised tokens (all processes):
        # after Accelerate's 1/accumulation and DDP's 1/world averaging, the gradient is the exact token mean.
        scale = self.args.accumulation_steps * self.world
        loss_sum = torch.zeros((), device=accelerator.device)
        stat_sums = torch.zeros(len(self.objective.stat_names), device=accelerator.device)
        diag: dict[str, float] = {}
        stats: dict[str, float] = {}
        # Hooks on a compiled module would make it recompile: the (rare) diagnostics step runs eagerly.
        stance = torch.compiler.set_stance("force_eager") if arm_diagnostics and self.compiled else nullcontext()
        with stance:
            for index, batch in enumerate(batches):
                last = index == len(batches) - 1
                if last and arm_diagnostics:
                    self.diagnostics.arm()
                with accelerator.accumulate(model):
                    micro_loss, micro_stats = self.objective.loss(model, batch, num_items)
                    loss_sum += micro_loss.detach().float()
                    stat_sums += micro_stats.float()
                    if last:
                        # The group's loss is known before its last backward, which DeepSpeed follows with the
                        # update: a non-finite loss stops the run before any update is applied, on every backend.
                        loss = float(accelerator.reduce(loss_sum, reduction="sum"))
                        if not math.isfinite(loss):
                            if arm_diagnostics:
                                self.diagnostics.disarm()
                            self.optimizer.zero_grad(set_to_none=True)
                            return "diverged", loss, float("nan"), diag, stats, real_tokens
                    accelerator.backward(micro_loss * scale)
        if self.objective.stat_names:  # means over the step's units, all processes
            stat_means = (accelerator.reduce(stat_sums, reduction="sum") / num_items).tolist()
            stats = dict(zip(self.objective.stat_names, stat_means))
        scaler = accelerator.scaler  # fp16 only
        if arm_diagnostics:  # under fp16 the gradients are still scaled here
            diag = self.diagnostics.after_backward(loss_scale=scaler.get_scale() if scaler is not None else 1.0)
        max_norm = self.args.grad_clip if self.args.grad_clip > 0 else float("inf")
        grad_norm = self._grad_norm(max_norm)
        checked_norm = 0.0 if grad_norm is None else grad_norm
        if scaler is None:
            outcome = step_outcome(loss, checked_norm, scaler_skipped=None)
            if outcome == "applied":
                self.optimizer.step()
        else:
            # Always step: the scaler itself skips an update whose gradients overflowed and lowers its scale.
            self.optimizer.step()
            outcome = step_outcome(loss, checked_norm, scaler_skipped=accelerator.optimizer_step_was_skipped)
        if outcome == "applied":
            self.scheduler.step()
            if arm_diagnostics:
                diag.update(self.diagnostics.after_step())
        self.optimizer.zero_grad(set_to_none=True)
        return outcome, loss, float("nan") if grad_norm is None else grad_norm, diag, stats, real_tokens

    def _start_epoch(self, epoch: int, samples_done: int):
        """An iterator over this process's batches of `epoch`, from global sample `samples_done` of the epoch's
        order on, and how many optimizer steps it holds."""
        self.data.train_sampler.set_position(epoch, samples_done)
        self.train_loader.set_epoch(epoch)  # Accelerate's loader passes its own epoch counter to the sampler
        return iter(self.train_loader), len(self.train_loader) // self.args.accumulation_steps

    def run(self) -> RunSummary:
        args, accelerator = self.args, self.accelerator
        step = epoch = samples_done = tokens_seen = 0
        if self.resume_from is not None:
            load_checkpoint(accelerator, self.resume_from)
            # Accelerate restores its micro-batch counter, which decides on which micro-batch the gradients sync
            # and the optimizer steps; counted under another --accumulation_steps it would put the update in the
            # middle of a group. A resumed run always starts on a group boundary.
            accelerator.step = 0
            state = self.resume_state
            step, tokens_seen = state["step"], state["tokens_seen"]
            epoch, samples_done = saved_position(state)
            self.metrics.truncate_after(step)
            self._print(f"resumed from {self.resume_from} at optimizer step {step} (epoch {epoch}, sample "
                        f"{samples_done} of {len(self.data.train)})" + (f"; {self.resume.note}" if self.resume.note
                                                                       else ""))
        else:
            if args.resume == "auto":
                self._print(f"--resume auto: no checkpoint in {self.out_dir / CHECKPOINT_DIR}; starting fresh")
            self.metrics.reset()
        if self.is_main:
            self._announce()
        progress = tqdm(total=self.total_steps, initial=step, disable=not self.is_main, dynamic_ncols=True,
                        desc=args.task)
        step_times: list[float] = []
        self.session_step_times = step_times
        step_token_counts: list[int] = []
        window_tokens, window_time, window_losses, window_stats = 0, 0.0, [], []
        self.model.train()
        first_step = step
        while step < self.total_steps:
            batch_iter, steps_here = self._start_epoch(epoch, samples_done)
            for _ in range(steps_here):
                if step >= self.total_steps:
                    break
                started = time.perf_counter()
                batches = [next(batch_iter) for _ in range(args.accumulation_steps)]
                arm = self.diagnostics is not None and step % args.diag_interval == 0
                outcome, loss, grad_norm, diag, stats, step_tokens = self._optimizer_step(batches, arm)
                if outcome == "diverged":
                    return self._diverged(step, epoch, samples_done, tokens_seen, progress)
                step += 1
                if step == first_step + 1:  # set-up and the first (compiling) step are done: fail faster now
                    set_collective_timeout(args.dist_timeout)
                samples_done += self.global_batch
                tokens_seen += step_tokens
                elapsed = time.perf_counter() - started
                step_times.append(elapsed)
                step_token_counts.append(step_tokens)
                if self.budget is not None:
                    self._fix_budget_length(step, step_times, progress)
                window_tokens, window_time = window_tokens + step_tokens, window_time + elapsed
                window_losses.append(loss)
                window_stats.append(stats)
                lrs = scheduled_lrs(self.optimizer)
                lr = lrs["lr"]
                record = {"step": step, "split": "train", "loss": loss, **stats, **lrs, "grad_norm": grad_norm,
                          "tokens_seen": tokens_seen, "step_time_s": elapsed}
                if outcome == "skipped":
                    record["skipped"] = True  # fp16 gradient overflow: no update, the scaler lowered its scale
                self._log(record, to_tracker=False)
                if diag:
                    self._log({"step": step, "split": "diag", **diag})
                progress.update(1)
                if step % args.log_interval == 0 or step == self.total_steps:
                    tokens_per_s = window_tokens / max(window_time, 1e-9)
                    mfu = (tokens_per_s * self.flops_per_token / self.peak_flops) if self.peak_flops else float("nan")
                    stat_means = {name: statistics.fmean(s[name] for s in window_stats)
                                  for name in self.objective.stat_names}
                    progress.set_postfix(loss=f"{statistics.fmean(window_losses):.3f}",
                                         **{label: f"{stat_means[name]:.3f}"
                                            for name, label in self.objective.progress_labels.items()},
                                         lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", mfu=f"{mfu:.1%}")
                    if args.use_wandb:
                        self.accelerator.log({"train/loss": statistics.fmean(window_losses), "train/lr": lr,
                                              "train/grad_norm": grad_norm, "train/tokens_per_s": tokens_per_s,
                                              "train/mfu": mfu, "train/tokens_seen": tokens_seen,
                                              **{f"train/{name}": value for name, value in stat_means.items()}},
                                             step=step)
                    window_tokens, window_time, window_losses, window_stats = 0, 0.0, [], []
                if step % args.eval_interval == 0 and step < self.total_steps:
                    self._log_eval(step, self.evaluate(args.eval_batches))
                if step % args.save_interval == 0 and step < self.total_steps:
                    self._save(step, epoch, samples_done, tokens_seen)
            else:
                epoch, samples_done = epoch + 1, 0
        progress.close()
        return self._finish(step, tokens_seen, step_times, step_token_counts)

    def _fix_budget_length(self, step: int, step_times: list[float], progress) -> None:
        if self.budget.fixed:
            return
        length = self.budget.length_after(step, step_times, self.train_time_before_s)
        if self.world > 1:
            # Collective, on every step until the length is fixed: all processes stop where the main one decided.
            length = broadcast_object_list([length])[0]
            self.budget.fixed = length is not None
        if length is None:
            return
        self.total_steps = length
        progress.total = length
        progress.refresh()
        self._print(f"--time_budget_s {self.args.time_budget_s:g}: {length} optimizer steps fit (pace "
                    f"{statistics.median(step_times[1:] or step_times):.3f} s/step after the first step)")

    def _log_eval(self, step: int, result: EvalResult) -> None:
        self._log({"step": step, "split": "val", **result.logged()})
        self._print(f"step {step}: {result.describe()}")

    def _announce(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out_dir / CONFIG_FILE, yaml.safe_dump(self.config_dict, sort_keys=False))
        stats = dataset_stats(self.data.train)
        setup = str(self.accelerator.distributed_type).split(".")[-1]
        lines = [f"MiniNorm {self.args.task}: {self.num_params / 1e6:.2f}M parameters on {self.accelerator.device} "
                 f"x{self.world}, {self.args.dtype}, {setup}, compile {'on' if self.compiled else 'off'}, "
                 f"optimizer {self.args.optimizer}"
                 + (", gradient checkpointing" if self.args.gradient_checkpointing else ""),
                 f"data: {self.data.description}; {len(self.data.train)} train / {len(self.data.val)} val samples"
                 + (f"; stats {stats}" if stats else ""),
                 f"trainable parameters: {self.trainable_params:,} of {self.num_params:,} "
                 f"({self.trainable_params / self.num_params:.2%})",
                 f"{self.total_steps} optimizer steps ({self.steps_per_epoch} per epoch), global batch "
                 f"{self.global_batch} x {self.args.max_seq_len} tokens"]
        if update_inside_backward(self.accelerator):
            lines.append("note: DeepSpeed applies each update inside backward, before the trainer sees the gradient: "
                         "a non-finite loss still stops the run before its update, but a non-finite gradient under a "
                         "finite loss is caught one update late (resume from the previous --save_interval checkpoint)")
        lines += ["effective config:", yaml.safe_dump(self.config_dict, sort_keys=False).rstrip()]
        tqdm.write("\n".join(lines))

    def _diverged(self, step: int, epoch: int, samples_done: int, tokens_seen: int, progress) -> RunSummary:
        progress.close()
        checkpoint = self._save(step, epoch, samples_done, tokens_seen)
        summary = RunSummary(status="diverged", out_dir=str(self.out_dir), steps=step, tokens_seen=tokens_seen,
                             num_params=self.num_params, wall_time_s=time.perf_counter() - self.started)
        self._write_summary(summary)
        self.accelerator.end_training()
        raise TrainingDiverged(step + 1, checkpoint)

    def _write_summary(self, summary: RunSummary) -> None:
        if self.is_main:
            atomic_write_text(self.out_dir / SUMMARY_FILE, json.dumps(summary.__dict__, indent=2))

    def _whole_model(self) -> MiniNormForCausalLM | None:
        """Collective. The trained model as one plain module on the main process (None elsewhere): the model
        itself, or, when its weights are sharded, a copy assembled from every process's shard."""
        if not self.sharded:
            return self.unwrapped if self.is_main else None
        state_dict = full_state_dict(self.accelerator, self.model)
        if not self.is_main:
            return None
        with torch.device("meta"):
            model = MiniNormForCausalLM(self.unwrapped.config)
        model.load_state_dict(state_dict, assign=True)
        model.tie_weights()
        return model

    def _save_merged(self, adapted: torch.nn.Module) -> None:
        """OUT_DIR/merged: a plain model directory with the adapters folded into the weights (and this run's
        config, so tools know it is a chat model)."""
        from model.lora import merged_model

        merged_dir = self.out_dir / MERGED_DIR
        save_model_dir(merged_model(adapted), self.tokenizer, merged_dir)
        atomic_write_text(merged_dir / CONFIG_FILE, yaml.safe_dump(self.config_dict, sort_keys=False))

    def _finish(self, step: int, tokens_seen: int, step_times: list[float], step_tokens: list[int]) -> RunSummary:
        final = self.evaluate(0)
        self._log_eval(step, final)
        median = statistics.median(step_times) if step_times else float("nan")
        # Real (unpadded) tokens over all processes, as the progress bar counts them, per second of training step;
        # the first step of the session (compilation, allocator warm-up) is left out when there are others.
        skip = 1 if len(step_times) > 1 else 0
        tokens_per_s = sum(step_tokens[skip:]) / sum(step_times[skip:]) if step_times else float("nan")
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else float("nan")
        whole = self._whole_model()
        self.accelerator.wait_for_everyone()
        summary = RunSummary(status="finished", out_dir=str(self.out_dir), steps=step, tokens_seen=tokens_seen,
                             num_params=self.num_params, final_val=final.as_dict(), median_step_time_s=median,
                             tokens_per_s=tokens_per_s, mfu=mfu, wall_time_s=time.perf_counter() - self.started)
        if self.is_main:
            save_model_dir(whole, self.tokenizer, self.out_dir)
            saved = f"{'LoRA adapter' if self.args.task == 'lora' else 'model'} saved to {self.out_dir}"
            if self.args.task == "lora" and self.args.merge:
                self._save_merged(whole)
                saved += f"; the merged model to {self.out_dir / MERGED_DIR}"
            with torch.compiler.set_stance("force_eager"):  # decoding shapes change every token: no compile
                summary.sample = _sample_text(whole, self.tokenizer, self.args)
            self._write_summary(summary)
            tqdm.write(f"done: {step} steps, {tokens_seen:,} tokens in {summary.wall_time_s:.0f} s; "
                       f"{final.describe()}; median step {median * 1000:.0f} ms, {tokens_per_s:,.0f} tok/s, "
                       f"MFU {mfu:.1%}")
            tqdm.write(f"sample: {summary.sample}")
            tqdm.write(saved)
        if self.args.use_wandb:
            self.accelerator.log({**{f"final/{name}": value for name, value in final.logged().items()},
                                  "final/tokens_per_s": tokens_per_s}, step=step)
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        return summary


def main(task: str, argv: list[str] | None = None) -> RunSummary:
    """Entry point of the thin trainer scripts."""
    from trainer.args import parse_args
    args = parse_args(task, argv)
    try:
        return Trainer(args).run()
    except TrainingDiverged as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_DIVERGED) from None
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(report_error(error)) from None
    except RuntimeError as error:
        if not collective_timed_out(error):
            raise
        rank = os.environ.get("RANK", "0")
        print(f"error: rank {rank} stopped: another process did not answer in time (--dist_timeout; "
              f"--dist_init_timeout until the first step is done): a node died or the network failed "
              f"({str(error).splitlines()[0]}); resume with --resume auto when every node is back", file=sys.stderr)
        raise SystemExit(EXIT_PEER_LOST) from None
    finally:
        shutdown()
