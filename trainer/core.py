"""The training core shared by pretraining, SFT, LoRA, DPO, distillation, GRPO and PPO: the run's set-up order and
its loop.

Accelerate owns devices, mixed precision, gradient accumulation and DDP/FSDP; this module owns the run's order:
`Trainer.__init__` sets the run up piece by piece (each reads what the ones before it set up, and every refusal comes
before a previous run's files are touched), and its loop (`Trainer.run`) takes optimizer steps over groups of
`accumulation_steps` micro-batches (`Trainer.train_step`, which returns a trainer/step.py `StepResult`; each update is
trainer/update.py's). The loop hands each result to components that decide their own timing: the reporter
(trainer/reporting.py: progress bar, metrics.jsonl, wandb), evaluation, checkpoints and diagnostics at their
intervals (trainer/intervals.py), the time budget's re-plan (trainer/run_length.py). A session's start says where it
starts (trainer/run_start.py); the end of the run writes its artifacts through trainer/export.py and its summary
through trainer/run_summary.py; the command line around the run is trainer/command.py. What differs between the
kinds of run is confined to three places: the model (trainer/run_inputs.py's `build_model`, which also checks the
run's input paths and loads its tokenizer; trainer/task_setup.py's `wrap_for_task`: LoRA wraps it with PEFT
adapters, PPO puts a critic beside it), the objective (trainer/task_setup.py's `build_objective` picks it:
trainer/objectives.py's language modeling, trainer/dpo.py's preference loss against a frozen reference model,
trainer/grpo.py's and trainer/ppo.py's policy losses on the rollouts they sample first; `train_step` is the one place
the loop meets it) and the data (trainer/data.py).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from model.model import MiniNormForCausalLM
from dataset.shown_value import flag_refusal
from trainer.arg_checks import check_model_flags_at_start
from trainer.arg_fields import (TrainArgs, build_model_config, loss_multipliers_set, requested_model_fields,
                                resolve_copy_rows, uses_lora)
from trainer.checkpoint import RunStart, agree_on_start, restore_and_clear, save_checkpoint
from trainer.checkpoint_state import OBJECTIVE_STATE_KEY, trainer_state
from trainer.data import build_run_data, data_identity, shard_loader
from trainer.distributed import (check_optimizer_supported, main_process_first, make_accelerator,
                                 materialize_meta_parameters, set_collective_timeout, state_is_sharded,
                                 weights_are_sharded)
from trainer.evaluation import token_byte_lengths
from trainer.export import sample_text, save_final_model, whole_model
from trainer.flops import flops_per_token, peak_flops_for
from trainer.intervals import Intervals
from trainer.machine import compile_enabled, compile_options, compile_problem, resolve_dtype
from trainer.memory import LOADING_DATA, check_largest_tensor_fits, working_on
from trainer.objectives import EvalResult
from trainer.optim import scheduled_lrs
from trainer.reporting import TrainingReporter
from trainer.resume_checks import (adopt_saved_architecture, check_resume_compatible, check_resume_length,
                                   check_same_task, check_saved_architecture)
from trainer.run_dir import CHECKPOINT_DIR, ROLLOUT_TASKS, resolve_input_path
from trainer.run_inputs import build_model, check_inputs, check_vocab_size, effective_config, load_run_tokenizer
from trainer.run_length import budget_length_after, budget_plan_line, plan_run_length
from trainer.run_optimizer import make_optimizer, make_scheduler
from trainer.run_start import announcement, start_position, write_run_config
from trainer.run_summary import RunSummary, TrainingDiverged, finished_run_summary, write_run_summary
from trainer.schedule import warmup_note
from trainer.step import NON_FINITE_LOSS, RunPosition, SamplingDiverged, SessionPace, StepResult, combine_updates
from trainer.storage_probe import probe_storage
from trainer.task_setup import build_objective, wrap_for_task
from trainer.threads import THREADS_KEY, ThreadPolicy, parse_threads
from trainer.update import GradientUpdate, token_counts
from trainer.wandb_run import check_wandb_login, start_wandb


class Trainer:
    """One training run. `run()` returns its summary; `TrainingDiverged` if the loss blows up.
    `on_results_written(out_dir)` is called on each process once the finished run's model and run_summary.json are
    written (the command makes a Ctrl-C from then on end the process with exit 0: trainer.cli.done_on_ctrl_c)."""

    def __init__(self, args: TrainArgs, on_results_written: Callable[[Path], None] | None = None) -> None:
        args.dtype = resolve_dtype(args.dtype)
        self.args = args
        self.on_results_written = on_results_written
        self.input_models = check_inputs(args)
        # Fine-tuning: the model directory it starts from, which DPO's, GRPO's and PPO's frozen reference (and PPO's
        # critic) are loaded from too, as check_inputs resolved and checked it before any work.
        self.starting_weights = self.input_models.get("--from_weight")
        self._start_processes()
        self.finished = finished_run_summary(self.accelerator, self.out_dir, args)
        if self.finished is not None:  # nothing left to set up either: run() returns it
            return
        # Each piece below reads what the ones above it set up, and every refusal comes before the first file of a
        # previous run is removed (restore_and_clear): the order is the run's, not a matter of taste.
        start = self._agree_on_run()
        with working_on(LOADING_DATA):
            self._load_data()
        with working_on("the set-up of the model, its optimizer and objective"):
            self._build_model_optimizer_objective()
        self._plan_length_and_compile()
        self._measure_throughput()
        # every input is checked by now: a refused run leaves the previous one whole
        restore_and_clear(self.accelerator, start, self.out_dir, args.resume, args.overwrite, self.shared_storage)
        self._start_reporting()

    def _start_processes(self) -> None:
        """The run's threads and processes (the accelerator): first, since the set-up itself runs at the thread
        count, and every collective from here on needs the processes; --norm_impl triton is refused as soon as the
        device is known."""
        args = self.args
        self.threads = ThreadPolicy(parse_threads(args.threads))  # first: the set-up runs at this count too
        self.threads.start()
        self.out_dir = args.resolved_out_dir()
        self.accelerator = make_accelerator(args.dtype, args.accumulation_steps, args.use_wandb,
                                            timeout_s=args.dist_init_timeout)
        if requested_model_fields(args).get("norm_impl") == "triton" and self.accelerator.device.type != "cuda":
            raise ValueError(f"--norm_impl triton needs a CUDA device (its kernels take GPU tensors), not "
                             f"{self.accelerator.device.type}; use auto or eager here")
        self.is_main = self.accelerator.is_main_process
        # torch.compile's build tools, checked once the device is known: --compile on and --norm_impl compile are
        # refused here, before the data is read; the auto choices stay eager (_plan_length_and_compile)
        self.compile_problem = compile_problem(self.accelerator.device)
        if self.compile_problem:
            for flag, asked, instead in (("compile", args.compile, "off"),
                                         ("norm_impl", requested_model_fields(args).get("norm_impl"), "eager")):
                if asked in ("on", "compile"):
                    raise ValueError(f"--{flag} {asked}: torch.compile cannot build here: {self.compile_problem}; or "
                                     f"run with --{flag} {instead}")
        self.world = self.accelerator.num_processes
        self.sharded = weights_are_sharded(self.accelerator)
        self.started = time.perf_counter()
        self.wandb_run_id: str | None = None

    def _agree_on_run(self) -> RunStart:
        """Every process agrees on which run this is (collective): wandb's login, the storage, fresh or resumed
        and from which checkpoint; a resume's task and architecture are checked and adopted here, before the data,
        so a refused architecture costs no tokenizing. Returns the agreed start (restore_and_clear acts on it once
        everything else is checked)."""
        args = self.args
        if args.use_wandb:
            check_wandb_login(self.accelerator, self.out_dir)
        # One --out_dir seen by every process, or one per machine (then each machine keeps a whole checkpoint).
        self.shared_storage = probe_storage(self.accelerator, self.out_dir,
                                            node_local_allowed=not state_is_sharded(self.accelerator))
        explicit = resolve_input_path(args.resume) if args.resume and args.resume != "auto" else None
        # One run per directory: refuse to replace or mix with another run there (--overwrite: its files go once
        # this run's inputs are all checked, clear_previous_files in restore_and_clear).
        start = agree_on_start(self.accelerator, args.resume, self.out_dir, explicit, overwrite=args.overwrite,
                               shared_storage=self.shared_storage)
        self.run_id = start.run_id
        self.resume = start.resume
        self.resume_from = self.resume.path if self.resume is not None else None
        self.resume_state = self.resume.state if self.resume is not None else None
        if self.resume_state is not None:  # before the data: a refused architecture costs no tokenizing
            check_same_task(self.resume_from, self.resume_state, args)
            adopt_saved_architecture(self.resume_from, self.resume_state, args)
        # the model flags' checks a pretraining --resume left for now, against the model it goes on with
        note = check_model_flags_at_start(args, resumed=self.resume_state is not None)
        if note and self.is_main:
            print(note, file=sys.stderr)
        self.threads.keep_runs((self.resume_state or {}).get(THREADS_KEY))
        return start

    def _load_data(self) -> None:
        """The tokenizer and the run's data, after the run is agreed (a resume's adopted flags decide them), from
        the run's seed; a --vocab_size the tokenizer overflows is refused before tokenizing, and a resume on other
        data once the data's identity is known."""
        args = self.args
        set_seed(args.seed)
        self.tokenizer = load_run_tokenizer(args)
        check_vocab_size(args, self.tokenizer)  # before the data: a refusal costs no tokenizing
        self._check_largest_tensor()
        self.data = main_process_first(self.accelerator,
                                       lambda: build_run_data(args, self.tokenizer, quiet=not self.is_main))
        self.data_identity = data_identity(self.data)
        if self.resume_state is not None:
            check_resume_compatible(self.resume_from, self.resume_state, args, self.data_identity)

    def _check_largest_tensor(self) -> None:
        """A run whose one micro-batch's logits are more than all its device's memory is refused before the data
        (trainer/memory.py): the vocabulary and positions are the starting model's (the flags' and the preset's when
        pretraining), and distillation's teacher has its own vocabulary."""
        from model.loading import load_config
        args, models = self.args, self.input_models
        start = models.get("--from_weight")
        config = load_config(start) if start is not None else build_model_config(args, len(self.tokenizer))
        teacher = load_config(models["--teacher"]).vocab_size if "--teacher" in models else None
        check_largest_tensor_fits(args, config.vocab_size, config.max_position_embeddings, self.accelerator.device,
                                  teacher)

    def _build_model_optimizer_objective(self) -> None:
        """The model (wrapped for the task), its optimizer and the objective, prepared by Accelerate with the
        training loader; after the data, seeded again so the initial weights do not depend on what building the
        data consumed; the validation loader sharded beside them."""
        args = self.args
        set_seed(args.seed)  # the same initial weights whatever the data building consumed
        base = self._base_model()
        self.config_dict = effective_config(args, base)
        if args.use_wandb:  # after the model: the logged config carries what the rules above resolved
            self.wandb_run_id = start_wandb(self.accelerator, args, self.out_dir, self.resume_state)
        self.model = wrap_for_task(base, args, self.sharded, self.starting_weights)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.trainable_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        check_optimizer_supported(self.accelerator, args.optimizer)
        self.optimizer = make_optimizer(self.model, args, self.accelerator.device)
        (self.model, self.optimizer, self.train_loader) = self.accelerator.prepare(
            self.model, self.optimizer, self.data.train_loader)
        self.unwrapped = self.accelerator.unwrap_model(self.model)
        self.base_model = base  # the MiniNormForCausalLM inside any wrapping (diagnostics, the model's shape)
        self.objective = build_objective(args, self.tokenizer, base, self.unwrapped, self.accelerator, self.sharded,
                                         self.starting_weights)
        load_state = getattr(self.objective, "load_state", None)
        if load_state is not None and self.resume_state is not None:  # an objective with state of its own (bco_pair)
            load_state(self.resume_state.get(OBJECTIVE_STATE_KEY, {}))
        # Validation shards are padded to equal length with samples that carry no target, so that every process
        # runs the same number of forward passes (a collective under FSDP) and no sample counts twice.
        self.val_loader = shard_loader(self.data.val_loader, self.accelerator.process_index, self.world)

    def _plan_length_and_compile(self) -> None:
        """The run's length (from the data and the global batch), then whether to compile (which the length
        decides), then the schedule over that length."""
        args = self.args
        self._plan_length()
        self.compiled = compile_enabled(args.compile, self.total_steps, args.time_budget_s)
        if self.compile_problem:  # what auto would have compiled runs eagerly, said once
            eager = ["the norms (norm_impl auto)"] if self.base_model.config.norm_impl == "auto" else []
            if self.compiled:
                eager.append("the model (--compile auto)")
            if eager and self.is_main:
                print(f"note: {' and '.join(eager)} run eagerly: torch.compile cannot build here: "
                      f"{self.compile_problem}", file=sys.stderr)
            self.compiled = False
        if self.compiled:
            # in place: same module, same state_dict keys, so checkpoints do not care
            self.unwrapped.compile(options=compile_options(self.accelerator.device, args.gradient_checkpointing))
        # The schedule reads the run's length at every step: a time budget fixes it after a few steps.
        self.scheduler = self.accelerator.prepare(make_scheduler(self.optimizer, args, lambda: self.total_steps))

    def _measure_throughput(self) -> None:
        """What the reporter measures the run with: each token's bytes (bits per byte), the model's FLOPs per
        token and the device's peak (MFU); after the model, whose shape and size they read."""
        args = self.args
        self.token_bytes = token_byte_lengths(self.tokenizer)
        self.flops_per_token = flops_per_token(self.base_model.config, self.num_params, args.max_seq_len)
        self.peak_flops = args.peak_flops or peak_flops_for(self.accelerator.device, args.dtype)

    def _start_reporting(self) -> None:
        """The reporter (progress bar, metrics.jsonl, wandb) and, with --diag_interval, the norm diagnostics; last,
        on the set-up complete and the previous run's files cleared: run() starts writing through them."""
        args = self.args
        self.reporter = TrainingReporter(self.accelerator, self.objective, self.out_dir, task=args.task,
                                         log_interval=args.log_interval, use_wandb=args.use_wandb,
                                         flops_per_token=self.flops_per_token, peak_flops=self.peak_flops,
                                         current_lrs=lambda: scheduled_lrs(self.optimizer))
        self.diagnostics = None
        if args.diag_interval:
            from trainer.diagnostics import NormDiagnostics
            self.diagnostics = NormDiagnostics(self.base_model)

    def _base_model(self) -> MiniNormForCausalLM:
        """The model this run trains, before any wrapping: fresh or the starting weights, checked against a
        resumed checkpoint's architecture and against --max_seq_len; the copy rows resolved by its switches."""
        args = self.args
        base, self.added_switches = build_model(args, self.tokenizer, self.starting_weights)
        materialize_meta_parameters(base)  # before the optimizer holds them (FSDP's loading on the other processes)
        if self.resume_state is not None:
            check_saved_architecture(self.resume_from, self.resume_state, base.config)
        args.copy_rows = resolve_copy_rows(args, self.added_switches)  # unset: by whether smeared keys are new
        positions = base.config.max_position_embeddings
        if args.max_seq_len > positions:
            raise ValueError(f"--max_seq_len={args.max_seq_len} exceeds the model's max_position_embeddings="
                             f"{positions}")
        if args.task in ROLLOUT_TASKS and args.max_seq_len >= positions:
            # A prompt as long as --max_seq_len is kept, and would fill the context: the first rollout would stop
            # the run with no room for a completion's first token.
            raise ValueError(f"--max_seq_len={args.max_seq_len} keeps prompts that fill the model's "
                             f"max_position_embeddings={positions}, leaving no room for a completion: a prompt of up "
                             f"to --max_seq_len tokens and its completion of up to --max_completion_length="
                             f"{args.max_completion_length} must fit together")
        if args.task in ROLLOUT_TASKS and args.max_seq_len + args.max_completion_length > positions:
            # a rollout is one sequence, the prompt and its completion: their positions past the model's failed
            # late (an OverflowError after the first rollout for a huge --max_completion_length)
            raise ValueError(flag_refusal("max_completion_length", args.max_completion_length,
                                          f"a prompt of up to --max_seq_len={args.max_seq_len} tokens and its "
                                          f"completion must fit the model's max_position_embeddings={positions}: it "
                                          f"must be at most {positions - args.max_seq_len} (or lower --max_seq_len)"))
        if args.gradient_checkpointing:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return base

    def _plan_length(self) -> None:
        """The run's length (trainer/run_length.py), checked against a resumed checkpoint's position; this
        session's pace and the training time spent before a resume."""
        length = plan_run_length(self.args, len(self.data.train), self.world, self.resume_state)
        self.global_batch, self.steps_per_epoch = length.global_batch, length.steps_per_epoch
        self.total_steps, self.budget = length.total_steps, length.budget
        if self.resume_state is not None:  # before any file is removed (restore_and_clear)
            check_resume_length(self.resume_from, self.resume_state, self.args, self.total_steps)
        self._announced_length: int | None = None  # the last length a time budget's plan printed
        self.pace = SessionPace()  # this session's optimizer steps (the budget's pace, checkpoints' training time)
        self.train_time_before_s: float = (self.resume_state or {}).get("train_time_s", 0.0)

    # ----------------------------------------------------------------- the loop
    def run(self) -> RunSummary:
        """Train to the end of the run (or of its time budget), then evaluate, save and sample. Each component
        decides its own timing: the reporter when it logs, the intervals when to evaluate, checkpoint and probe."""
        if self.finished is not None:
            self._results_written()  # written by the session that finished the run
            self.accelerator.end_training()
            return self.finished
        position = self._start()
        try:
            return self._train_and_finish(position)
        except SamplingDiverged as error:  # a step's rollouts or a validation's greedy ones, every process agreeing
            return self._diverged(position, str(error), in_step=not error.validation)

    def _train_and_finish(self, position: RunPosition) -> RunSummary:
        """run()'s loop from `position`, then the run's end (_finish)."""
        args = self.args
        first_step, intervals = position.step, Intervals.from_args(args)
        self.model.train()
        try:
            for started, batches in self._step_batches(position):
                diagnose = intervals.diagnoses(position.step, self.total_steps)
                result = self.train_step(batches, arm_diagnostics=diagnose, step=position.step)
                if result.outcome == "diverged":
                    return self._diverged(position)
                result.time_s = time.perf_counter() - started
                position.advance(result, self.global_batch)
                self.pace.add(result)
                if position.step == first_step + 1:  # set-up and the first (compiling) step are done: fail faster
                    set_collective_timeout(args.dist_timeout)
                self._plan_budget_length(position.step)
                self.reporter.after_step(position, result, self.total_steps)
                # collective, both: every process evaluates its validation shard and saves its part
                if intervals.evaluates(position.step, self.total_steps):
                    self.reporter.log_eval(position.step, self.evaluate(args.eval_batches))
                if intervals.checkpoints(position.step, self.total_steps):
                    self._save(position)
        finally:  # also when a step raises (e.g. a GRPO reward function's breach): its error line follows the bar
            self.reporter.close()
        return self._finish(position)

    def _start(self) -> RunPosition:
        """Where this session starts (trainer/run_start.py): the resumed checkpoint's position (its state loaded at
        set-up), or a fresh run; said, then (main process) train_config.yaml written and the run announced."""
        position, lines = start_position(self.resume, self.args, self.out_dir, len(self.data.train), self.config_dict,
                                         self.total_steps)
        for line in lines:
            self.reporter.print(line)
        if self.is_main:
            # a time budget's length is planned after a few steps (and the scheduler then cuts the warmup to it)
            note = None if self.args.time_budget_s else warmup_note(self.args.warmup_steps, self.total_steps)
            if note:
                print(note, file=sys.stderr, flush=True)
            write_run_config(self.out_dir, self.config_dict, self.run_id)
            tqdm.write(announcement(
                self.args, self.accelerator, self.data, compiled=self.compiled, threads_line=self.threads.describe(),
                input_models=self.input_models, num_params=self.num_params, trainable_params=self.trainable_params,
                total_steps=self.total_steps, steps_per_epoch=self.steps_per_epoch, global_batch=self.global_batch,
                added_switches=self.added_switches, config_dict=self.config_dict))
        self.reporter.start(position.step if self.resume_from is not None else None, self.total_steps)
        return position

    def _step_batches(self, position: RunPosition) -> Iterator[tuple[float, list[dict[str, torch.Tensor]]]]:
        """The batch groups of the optimizer steps left, epoch after epoch from `position` on (which the loop
        advances), each with the time it was asked for: a step's time includes loading its batches."""
        while position.step < self.total_steps:
            self.data.train_sampler.set_position(position.epoch, position.samples_done)
            self.train_loader.set_epoch(position.epoch)  # Accelerate's loader passes its epoch to the sampler
            batch_iter = iter(self.train_loader)
            for _ in range(len(self.train_loader) // self.args.accumulation_steps):
                if position.step >= self.total_steps:
                    return
                started = time.perf_counter()
                yield started, [next(batch_iter) for _ in range(self.args.accumulation_steps)]
            position.epoch, position.samples_done = position.epoch + 1, 0

    # ----------------------------------------------------------------- one optimizer step
    def train_step(self, batches: list[dict[str, torch.Tensor]], arm_diagnostics: bool = False,
                   step: int = 0) -> StepResult:
        """Forward/backward over one group of micro-batches, then one optimizer step (unless the loss or gradient
        diverged, or an fp16 overflow made the scaler skip it). The objective decides the loss; this is the one
        place the loop meets it. An objective with `rollouts` (GRPO, PPO; distillation, whose --lmbda and --seq_kd
        steps train on sampled completions) first turns the micro-batches into sampled completions, seeded by
        `step` (the optimizer steps done), so a resumed run samples the same ones, and may take several optimizer
        updates on them (its `updates_per_rollout`: GRPO's --num_iterations, PPO's --ppo_epochs); the step is then
        all of them, and the schedule advances once per step. An objective with `count_step` (DPO where its loss
        reads the chosen answers' NLL) counts, over all processes, a second unit of the whole step that its loss
        divides by beside num_items (the chosen answers' tokens), and hands it to each micro-batch."""
        start_step = getattr(self.objective, "start_step", None)
        if start_step is not None:  # an objective whose loss depends on the step (copy rows' schedule and seeds)
            start_step(step)
        rollouts = getattr(self.objective, "rollouts", None)
        if rollouts is not None:  # collective: what spans the step's global batch is computed over all processes
            with working_on(f"step {step + 1}'s rollouts (its sampled completions)"):
                batches = rollouts(self.unwrapped, batches, step, self.accelerator)
        count_step = getattr(self.objective, "count_step", None)
        if count_step is not None:  # collective: a total beside num_items that the loss divides by (DPO's NLL tokens)
            count_step(batches, self.accelerator)
        num_items, real_tokens = token_counts(self.objective, batches, self.accelerator)
        num_items = num_items.clamp(min=1)
        arm_diagnostics = arm_diagnostics and self.diagnostics is not None
        updates = getattr(self.objective, "updates_per_rollout", 1)
        results = []
        for update in range(updates):  # a checkpoint never falls between them: a rollout is never saved
            with working_on(f"step {step + 1}'s forward and backward"):
                result = self._update(batches, num_items, real_tokens, arm_diagnostics and update == updates - 1)
            if result.outcome == "diverged":
                return result
            results.append(result)
        if any(result.outcome == "applied" for result in results):
            self.scheduler.step()
        result = combine_updates(results)
        end_step = getattr(self.objective, "end_step", None)
        if end_step is not None:  # an objective that carries something from step to step (bco_pair's mean)
            end_step(result.stats, int(num_items))
        return result

    def _update(self, batches: list[dict[str, torch.Tensor]], num_items: torch.Tensor, real_tokens: int,
                arm_diagnostics: bool) -> StepResult:
        """One optimizer update over the step's micro-batches (trainer/update.py; the schedule is train_step's),
        with the model and optimizer the trainer holds now."""
        update = GradientUpdate(self.accelerator, self.model, self.optimizer, self.objective, self.diagnostics,
                                self.compiled, self.args.accumulation_steps, self.args.grad_clip)
        return update.apply(batches, num_items, real_tokens, arm_diagnostics)

    # ----------------------------------------------------------------- the components' work
    def evaluate(self, max_batches: int) -> EvalResult:
        """Collective: every process evaluates its shard (the same number of batches on each)."""
        with working_on("the evaluation"):
            return self.objective.evaluate(self.unwrapped, self.val_loader, self.accelerator, self.token_bytes,
                                           max_batches)

    def _plan_budget_length(self, step: int) -> None:
        """Under --time_budget_s: plan the run's length from the pace after every step once the first steps are
        timed (trainer/run_length.py); say so when the plan is new or moved by 5% or more. Collective."""
        if self.budget is None:
            return
        length = budget_length_after(self.budget, step, self.pace.times, self.train_time_before_s, self.world)
        if length is None:
            return
        if length != self.total_steps:
            self.total_steps = length
            self.reporter.set_length(length)
        line = budget_plan_line(self.args.time_budget_s, length, self._announced_length, self.pace.times)
        if line is not None:
            self._announced_length = length
            self.reporter.print(line)

    def _state(self, position: RunPosition) -> dict[str, Any]:
        """What a checkpoint records beside the weights and optimizer (trainer/checkpoint_state.py's trainer_state)."""
        return trainer_state(position, total_steps=self.total_steps, processes=self.world, run_id=self.run_id,
                             data=self.data_identity, wandb_run_id=self.wandb_run_id, config=self.config_dict,
                             train_time_s=self.train_time_before_s + self.pace.seconds(),
                             budget_fixed=self.budget is not None and self.budget.fixed, threads=self.threads.threads,
                             objective_state=self.objective.state() if hasattr(self.objective, "state") else {})

    def _save(self, position: RunPosition) -> Path:
        return save_checkpoint(self.accelerator, self.out_dir / CHECKPOINT_DIR, position.step, self._state(position),
                               self.args.keep_checkpoints, shared_storage=self.shared_storage)

    # ----------------------------------------------------------------- the end of the run
    def _diverged(self, position: RunPosition, cause: str = NON_FINITE_LOSS, in_step: bool = True) -> RunSummary:
        """The state at `position` saved, run_summary.json "diverged", and TrainingDiverged naming the optimizer step
        (`in_step`: the one after `position`, which diverged; else `position`'s own, after which `cause` came)."""
        self.reporter.close()
        checkpoint = self._save(position)
        summary = RunSummary(status="diverged", out_dir=str(self.out_dir), steps=position.step,
                             tokens_seen=position.tokens_seen, num_params=self.num_params,
                             wall_time_s=time.perf_counter() - self.started)
        if self.is_main:
            write_run_summary(self.out_dir, summary)
        self.accelerator.end_training()
        raise TrainingDiverged(position.step + int(in_step), checkpoint, cause, loss_multipliers_set(self.args))

    def _finish(self, position: RunPosition) -> RunSummary:
        """Collective: the final evaluation, then (main process) the model directory, the merged model of a LoRA
        run with --merge, the sample and run_summary.json."""
        final = self.evaluate(0)
        tokens_per_s, mfu = self.pace.tokens_per_s(), self.reporter.mfu(self.pace.tokens_per_s())
        self.reporter.log_final(position.step, final, tokens_per_s)
        whole = whole_model(self.accelerator, self.model, self.unwrapped, self.sharded)
        whole = getattr(whole, "policy", whole)  # PPO trains its policy beside a critic: the policy is the model
        self.accelerator.wait_for_everyone()
        summary = RunSummary(status="finished", out_dir=str(self.out_dir), steps=position.step,
                             tokens_seen=position.tokens_seen, num_params=self.num_params,
                             final_val=final.as_dict(), median_step_time_s=self.pace.median_step_s(),
                             tokens_per_s=tokens_per_s, mfu=mfu, wall_time_s=time.perf_counter() - self.started)
        if self.is_main:
            saved = save_final_model(whole, self.tokenizer, self.out_dir, self.config_dict, uses_lora(self.args),
                                     self.args.merge)
            with torch.compiler.set_stance("force_eager"):  # decoding shapes change every token: no compile
                summary.sample = sample_text(whole, self.tokenizer, self.args.task, self.args.sample_prompt,
                                             self.args.seed)
            write_run_summary(self.out_dir, summary)  # the last of the results: the run is finished from here on
            self._results_written()
            tqdm.write(summary.done_line(final.describe()))
            tqdm.write(f"sample: {summary.sample}")
            tqdm.write(saved)
        self.accelerator.wait_for_everyone()
        self._results_written()  # the other processes know it here
        self.accelerator.end_training()
        return summary

    def _results_written(self) -> None:
        if self.on_results_written is not None:
            self.on_results_written(self.out_dir)
