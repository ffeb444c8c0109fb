"""The distillation training loop: AdamW, warmup + linear/cosine decay, clipping,
accumulation, data parallelism, exact resume, metrics.

Data order: the packed rows are shuffled once per epoch by a generator seeded with
(seed, epoch); optimizer step s of epoch e takes the next `global_batch` rows of that
order, and process r the r-th share of them. The position in the data is therefore a
function of the step number alone, so a resumed run (same recipe) sees exactly the rows the
uninterrupted run would have seen.

A training state (OUT/checkpoints/step-NNNNNNN/state.pt) holds the trainable parameters,
the optimizer and scheduler states, the step, the RNG states and the recipe's
trajectory keys; resuming from it continues bit-for-bit on the same machine.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.errors import ConfigError
from kvforge.tools.swiftkv.data import PackedData
from kvforge.tools.swiftkv.loss import distill_loss
from kvforge.tools.swiftkv.parallel import DataParallel
from kvforge.tools.swiftkv.recipe import DistillRecipe
from kvforge.tools.swiftkv.sharding import (
    full_optimizer_state,
    full_tensor,
    is_sharded,
    load_full_optimizer_state,
)
from kvforge.tools.swiftkv.student import DistillModel

STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"
LOSS_PLOT_FILE = "loss.png"
CHECKPOINTS_DIR = "checkpoints"

StepCallback = Callable[[int, dict[str, Any]], None]


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): linear warmup
    over `warmup` steps (the first step already moves), then linear or cosine decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def state_dirs(out: Path) -> list[Path]:
    """Complete training states under OUT/checkpoints, oldest first."""
    root = out / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.name.startswith("step-") and (d / STATE_FILE).is_file())


class Trainer:
    def __init__(self, model: DistillModel, data: PackedData, recipe: DistillRecipe, out: str | Path,
                 parallel: DataParallel | None = None, progress: bool = True) -> None:
        self.model, self.data, self.recipe = model, data, recipe
        self.out = Path(out)
        self.parallel = parallel or DataParallel()
        self.progress = progress and self.parallel.is_main
        self.params = model.trainable()
        if not self.params:
            raise ConfigError("student", "no trainable parameters", "the student must have SwiftKV parameters")
        # FSDP (kvforge.tools.swiftkv.sharding) reduce-scatters the gradients itself.
        self.sharded = is_sharded(self.params.values())
        self.per_process = recipe.micro_batch_size * recipe.grad_accum
        self.global_batch = self.per_process * self.parallel.world_size
        self.steps_per_epoch = data.num_rows // self.global_batch
        if self.steps_per_epoch < 1:
            raise ConfigError("data", f"{data.num_rows} packed rows of {data.seq_len} tokens",
                              f"must fill at least one optimizer step of micro-batch-size x grad-accum x processes "
                              f"= {self.global_batch} rows")
        self.total_steps = recipe.max_steps or max(1, math.ceil(recipe.epochs * self.steps_per_epoch))
        self.warmup_steps = min(self.total_steps, round(recipe.warmup_ratio * self.total_steps))
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=recipe.learning_rate,
                                           weight_decay=recipe.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, self.warmup_steps, recipe.lr_schedule))
        self.records: list[dict[str, Any]] = []
        self.started = False
        self.step = 0
        self.tokens_trained = 0
        self.elapsed_before = 0.0

    # -- data ---------------------------------------------------------------------------
    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """Row indices of this process's micro-batches for optimizer step `step`."""
        epoch, within = divmod(step, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.recipe.seed * 1_000_003 + epoch)
        order = torch.randperm(self.data.num_rows, generator=generator)
        first = within * self.global_batch + self.parallel.rank * self.per_process
        mine = order[first:first + self.per_process]
        size = self.recipe.micro_batch_size
        return [mine[i:i + size] for i in range(0, self.per_process, size)]

    # -- one step -----------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        recipe, device = self.recipe, self.parallel.device
        batches = [self.data.rows(index) for index in self.micro_batches(step)]
        counts = torch.tensor([float(sum(int(c.sum()) for _, _, c in batches))], dtype=torch.float64, device=device)
        normaliser = max(float(self.parallel.sum_(counts)), 1.0)
        hidden_layer = None
        if recipe.hidden_loss_weight > 0:
            hidden_layer = recipe.hidden_loss_layer or self.model.teacher.config.num_layers
        student = self.model.student
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, kl, mse, early-exit kl
        for tokens, segments, counted in batches:
            tokens, segments, counted = tokens.to(device), segments.to(device), counted.to(device)
            pair = self.model.forward_hidden(tokens, segments, hidden_layer, autocast=recipe.bf16)
            parts = distill_loss(pair, counted, student.model.norm, student.lm_head, normaliser,
                                 recipe.temperature, recipe.kl_chunk_tokens, recipe.hidden_loss_weight)
            parts.total.backward()
            sums += torch.tensor([float(parts.total.detach()), parts.kl, parts.hidden_mse, parts.early_kl],
                                 dtype=torch.float64, device=device)
        params = list(self.params.values())
        if not self.sharded:
            self.parallel.sum_gradients(params)
        self.parallel.sum_(sums)
        limit = recipe.max_grad_norm if recipe.max_grad_norm > 0 else float("inf")
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, limit)))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = self.global_batch * self.data.seq_len
        early = {"early_exit_kl": float(sums[3])} if self.model.swift.early_exit_head else {}
        return {"step": step + 1, "loss": float(sums[0]), "kl": float(sums[1]), "hidden_mse": float(sums[2]), **early,
                "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "counted_tokens": int(normaliser)}

    # -- the loop -----------------------------------------------------------------------
    def train(self, on_step: StepCallback | None = None) -> list[dict[str, Any]]:
        """Run (or continue) to `total_steps`; returns the records of the steps run now."""
        self.start()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="distill", unit="step",
                   disable=not self.progress)
        start_time = time.perf_counter()
        run_tokens = 0
        done: list[dict[str, Any]] = []
        while self.step < self.total_steps:
            record = self.train_step(self.step)
            self.step += 1
            run_tokens += record["tokens"]
            self.tokens_trained += record["tokens"]
            run_time = time.perf_counter() - start_time
            record.update(tokens_trained=self.tokens_trained, elapsed_s=round(self.elapsed_before + run_time, 3),
                          tokens_per_s=round(run_tokens / max(run_time, 1e-9), 1))
            self.records.append(record)
            done.append(record)
            self.log(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            bar.update(1)
            if self.step % self.recipe.save_every == 0 or self.step == self.total_steps:
                self.save_state(run_time)
            if on_step is not None:
                on_step(self.step, record)
        bar.close()
        if self.parallel.is_main:
            plot_loss(self.records, self.out / LOSS_PLOT_FILE)
        return done

    def start(self) -> int:
        """Load the state to resume from (recipe `resume`) or begin a fresh metrics log;
        returns the step training continues from. Idempotent."""
        if not self.started:
            self._start()
            self.started = True
        return self.step

    def _start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        source = self._resume_source()
        metrics = self.out / METRICS_FILE
        if source is None:
            if self.parallel.is_main:  # a fresh run replaces an earlier run's log and states in OUT
                metrics.write_text("")
                shutil.rmtree(self.out / CHECKPOINTS_DIR, ignore_errors=True)
            return
        self.load_state(source)
        kept = []
        if metrics.is_file():  # drop what the interrupted run logged after its last state
            for line in metrics.read_text().splitlines():
                entry = json.loads(line)
                if entry.get("step", 0) <= self.step:
                    kept.append(entry)
        self.records = [e for e in kept if "event" not in e]
        if self.parallel.is_main:
            metrics.write_text("".join(json.dumps(e) + "\n" for e in kept))

    def _resume_source(self) -> Path | None:
        resume = self.recipe.resume
        if resume is None:
            return None
        if resume == "auto":
            states = state_dirs(self.out)
            return states[-1] if states else None
        path = Path(resume).expanduser()
        if (path / STATE_FILE).is_file():
            return path
        states = state_dirs(path)  # an output directory
        if not states:
            raise ConfigError("resume", resume, f"must be a training state directory (with {STATE_FILE}), an output "
                                                "directory holding checkpoints/, or 'auto'")
        return states[-1]

    # -- states -------------------------------------------------------------------------
    def save_state(self, run_time: float) -> None:
        # Every process gathers (a collective when sharded); the main one writes.
        trainable, optimizer = self.model.trainable_state(), full_optimizer_state(self.optimizer)
        if not self.parallel.is_main:
            return
        state = {
            "step": self.step,
            "tokens_trained": self.tokens_trained,
            "elapsed_s": self.elapsed_before + run_time,
            "trainable": trainable,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "trajectory": self.recipe.trajectory(),
        }
        directory = self.out / CHECKPOINTS_DIR / f"step-{self.step:07d}"
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, directory / STATE_FILE)  # a state is either complete or absent
        for old in state_dirs(self.out)[:-self.recipe.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        plot_loss(self.records, self.out / LOSS_PLOT_FILE)

    def load_state(self, directory: Path) -> None:
        # Loaded on the CPU: the RNG states must be CPU byte tensors (torch.cuda.set_rng_state_all
        # rejects CUDA ones), and the parameters and optimizer state are copied to their
        # parameters' device below.
        state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False)
        theirs, mine = state["trajectory"], self.recipe.trajectory()
        changed = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
        if changed:
            raise ConfigError("resume", str(directory), "was written with a different recipe (" + ", ".join(
                f"{k.replace('_', '-')}: {theirs.get(k)!r} -> {mine.get(k)!r}" for k in changed) + ")")
        self.model.load_trainable_state(state["trainable"])
        load_full_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step = int(state["step"])
        self.tokens_trained = int(state["tokens_trained"])
        self.elapsed_before = float(state["elapsed_s"])

    def log(self, entry: dict[str, Any]) -> None:
        """Append one line to OUT/metrics.jsonl (main process only)."""
        if self.parallel.is_main:
            with (self.out / METRICS_FILE).open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")


def plot_loss(records: list[dict[str, Any]], path: Path) -> None:
    """Loss against tokens trained (log scale when positive), one point per optimizer step."""
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["tokens_trained"] for r in records], [r["loss"] for r in records], lw=1)
    ax.set_xlabel("tokens trained")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, 1M: plain integers overlap
    ax.set_ylabel("loss (T^2 KL + hidden MSE)")
    if min(r["loss"] for r in records) > 0:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.set_title("SwiftKV distillation")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
