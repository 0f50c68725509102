"""The training loop every rank runs: grid -> workload (reader + model) -> optimizer -> gradient
sync -> timed steps, with records, validation, checkpoints and the stop-signal contract.

Run by ``hpcpar run`` as ``python -m hpcpar.run.trainer RUN/job.json --run-dir RUN [--resume]`` on
every rank, or in-process with :func:`train`. Each step is timed per phase (data wait, forward,
backward, exposed allreduce, optimizer; halo and allreduce totals from
``hpcpar.parallel.counters.COUNTERS``) and recorded (:class:`hpcpar.formats.records.RunRecorder`).
Between the gradient sync and the optimizer step, one small allreduce gives all ranks the mean
loss, whether any rank got SIGUSR1/SIGTERM/SIGINT (all ranks stop, checkpoint and exit 3 after the
same step) and whether any rank saw a non-finite loss or gradient (``[train] on_nonfinite =
"stop"`` ends the run there with exit 4 and status "diverged", keeping the last finite
checkpoint; ``"skip"`` skips that optimizer step and counts it). Under ``precision = "fp16"`` the
loss is scaled (:mod:`hpcpar.run.loss_scale`) and the gradients unscaled before that check; a
non-finite gradient with every loss finite is an overflow: the step is skipped on every rank,
the scale backs off alike everywhere, and the run goes on.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcpar import _env
from hpcpar.errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REQUEUE,
    EXIT_USAGE,
    ConfigError,
    DataError,
    DivergedError,
    HpcparError,
    RunDirError,
)
from hpcpar.formats import rundir
from hpcpar.formats.jobspec import load_resolved, profile_window
from hpcpar.formats.records import RunRecorder, open_nofollow, row_from_counters, write_json_atomic
from hpcpar.formats.records.history import PackedHistory, history_rows
from hpcpar.parallel.agree import agree
from hpcpar.parallel.counters import COUNTERS
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.placement import rank_info, select_device
from hpcpar.run import init_weights, rerun
from hpcpar.run._optim import (
    build_scheduler,
    build_training_optimizer,
    current_lr,
    hyperparameters,
    resume_settings,
)
from hpcpar.run.callbacks import job_callbacks
from hpcpar.run.checkpoint import capture, finite, resume, store
from hpcpar.run.checkpoint_writer import CheckpointWriter
from hpcpar.run.data_identity import data_identity
from hpcpar.run.grad_clip import clip_, norm_share, spatial_share, squared_norm
from hpcpar.run.loss_scale import LossScaler
from hpcpar.run.profiling import ProfileWindow
from hpcpar.run.signals import StopRequest
from hpcpar.run.workloads.base import get_workload
from hpcpar.sync.replicas import check_replicas

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch
    from mpi4py import MPI

    from hpcpar.formats.jobspec import JobSpec

__all__ = ["TrainResult", "Verdict", "grads_finite", "peak_memory", "total_steps", "Trainer",
           "train", "main"]


@dataclass
class TrainResult:
    """What [train][hpcpar.run.trainer.train] returns: the ``step``s completed, whether a signal
    ``stopped`` the run after a checkpoint (exit code 3), the final evaluation ``metrics``, and
    the optimizer steps skipped for a non-finite loss (``skipped_steps``, ``on_nonfinite =
    "skip"``) or for an fp16 gradient overflow (``overflow_steps``, ``precision = "fp16"``; not
    a divergence: the loss scale backs off)."""

    step: int
    stopped: bool = False
    metrics: dict = field(default_factory=dict)
    skipped_steps: int = 0
    overflow_steps: int = 0


@dataclass
class Verdict:
    """What all ranks agreed on for one step (the result of the one allreduce)."""

    stop: bool = False              # some rank got a stop signal
    mean_loss: float = float("nan")
    bad_loss: int = 0               # ranks whose loss is non-finite
    bad_grad: int = 0               # ranks holding a non-finite gradient
    overflow: bool = False          # fp16: only gradients non-finite (the scale backs off)
    grad_norm: float = float("nan")  # global gradient 2-norm (only with clip_grad_norm)

    @property
    def finite(self) -> bool:
        return not (self.bad_loss or self.bad_grad)


@dataclass
class _LoopState:
    """What one :meth:`Trainer.run` carries from step to step."""

    t_start: float
    steps_done: int = 0
    samples_done: int = 0
    mean_loss: float = float("nan")
    stopped: bool = False
    last_ckpt: Path | None = None
    epoch: int | None = None
    it: Iterator | None = None
    bar: Any = None  # a tqdm bar (tqdm ships no types)
    window: list = field(default_factory=list)   # mean losses since the last log line
    diverged: str | None = None     # the one-line reason, when the run diverged
    grad_norm: float = float("nan")  # the last step's global gradient norm before clipping


class RankLog:
    """Per-rank log file ``RUN/logs/rank-00003.log`` (lines prefixed ``[rank 3]``); rank 0 also
    echoes to stderr, through the tqdm bar when one is shown."""

    def __init__(self, run_dir: Path, rank: int, echo: bool):
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.prefix = f"[rank {rank}]"
        self.file = open(run_dir / "logs" / f"rank-{rank:05d}.log", "a", buffering=1,
                         opener=open_nofollow)   # never appends through a link placed there
        self.echo = echo
        self.bar = None

    def __call__(self, msg: str, echo: bool = True) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.file.write(f"{stamp} {self.prefix} {msg}\n")
        if self.echo and echo:
            if self.bar is not None:
                self.bar.write(f"hpcpar {msg}", file=sys.stderr)
            else:
                print(f"hpcpar {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()


def grads_finite(params) -> bool:
    """Whether every gradient of ``params`` is finite. A finite sum has no NaN or inf in it:
    one read-only pass (``isfinite`` allocates masks and took 56 ms a step on an
    11 M-parameter head, more than its optimizer); only a non-finite sum, which overflow can
    also give, is confirmed element by element
    (:func:`hpcpar.run.checkpoint.finite.finite_flags`)."""
    return all(finite.finite_flags([p.grad for p in params if p.grad is not None]))


def seed_all(seed: int) -> None:
    """Seed the Python, NumPy (modulo 2**32) and torch generators, so runs are reproducible."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def peak_memory(device: torch.device) -> float:
    """Peak memory in bytes: CUDA max allocated on a GPU, else this process's max RSS."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


def total_steps(job: JobSpec, steps_per_epoch: int) -> int:
    """How many optimizer steps the job runs: ``[train] steps``, else the epochs' batches
    (``steps_per_epoch`` each) over ``[train] accumulate`` (a remainder is not trained);
    ConfigError when the epochs hold fewer than ``accumulate`` batches."""
    t = job.train
    if t.steps is not None:
        return t.steps
    batches = (t.epochs or 0) * int(steps_per_epoch)
    if batches < t.accumulate:
        raise ConfigError(f"{job.source}: [train] accumulate: {t.accumulate} micro-batches per "
                          f"step, but [train] epochs = {t.epochs} hold only {batches} batches")
    return batches // t.accumulate


class Trainer:
    """One rank's training run; construction is collective (grid, model, resume)."""

    def __init__(self, job: JobSpec, run_dir, *, resume: bool = True, comm=None, device=None,
                 stop: StopRequest | None = None, callbacks=None,
                 start_from: str | os.PathLike | None = None):
        import torch

        self.job = job
        self.run_dir = Path(run_dir)
        self.grid = ProcessGrid.from_spec(job.grid_shape, comm=comm)
        self.comm = self.grid.comm
        self.rank = self.grid.rank
        self.stop = stop if stop is not None else StopRequest()
        self.device = device if device is not None else select_device()
        self.log = RankLog(self.run_dir, self.rank, echo=self.rank == 0)
        seed_all(job.train.seed)
        self.workload = get_workload(job.model.kind)(job, self.grid, self.device)
        self.model = self.workload.build_model()
        if job.train.activation_checkpointing is not False:
            from hpcpar.nn.checkpointing import checkpoint_activations  # deferred: loads torch

            checkpoint_activations(self.model, job.train.activation_checkpointing)
        self.spe = int(self.workload.steps_per_epoch())
        self.accumulate = int(job.train.accumulate)
        self.total = total_steps(job, self.spe)
        self.wrapped = self.workload.wrap(self.model)
        self.optimizer = build_training_optimizer(
            job.train, self.workload.param_groups(self.model), self.wrapped)
        self.scheduler = build_scheduler(self.optimizer, job.train, self.total)
        self._check_accumulate()
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.train.precision)
        self.autocast = torch.autocast(self.device.type, dtype=half) if half else None
        # [train] precision = "fp16": the agreed loss scale
        self.scaler = LossScaler() if job.train.precision == "fp16" else None
        self.step = 0
        self.history: list[list] = []      # [step, mean loss] at log points
        self._packed = (PackedHistory(), PackedHistory())  # both, as trainer.pt
        self.val_history: list[dict] = []
        self.skipped = 0                   # optimizer steps skipped for non-finite values
        self.overflows = 0                 # optimizer steps skipped for fp16 overflow
        self.resumed_from: Path | None = None
        self._grads_ok = True              # this rank's gradients of the current step
        self._norm_share = None            # [train] clip_grad_norm: this rank's share
        self._sharded = hasattr(self.optimizer, "norm_params")  # [train] shard_optimizer
        if job.train.clip_grad_norm:
            self._norm_share = (norm_share(self.model, self.grid) if not self._sharded
                                else spatial_share(self.model, self.grid))
        if start_from is not None:
            self._resume(Path(start_from))
        elif resume:
            self._resume()
        self._check_steps_left(start_from is not None)
        if self.resumed_from is None and job.train.init_from:
            self._init_weights(job.train.init_from)

        self.callbacks = job_callbacks(job) + list(callbacks or [])
        self.profiler = ProfileWindow(profile_window(job.profile.steps),
                                      self.run_dir / "profile", self.rank,
                                      torch.device(self.device).type,
                                      job.profile.record_shapes, job.profile.memory)

        self.writer = CheckpointWriter(self.ckpt_dir, self.comm, job.checkpoint.keep,
                                       background=job.checkpoint.background)
        # last: nothing below can fail and leave the comm bound to a group
        from hpcpar.parallel.transport import use_transport  # deferred: loads torch

        try:
            self.transport = use_transport(self.grid, job.train.halo_transport, self.device)
        except HpcparError as exc:  # decided alike on every rank
            raise _collective(exc) from None
        if self.rank == 0:
            self.log(f"{job.name}: {job.model.kind} on grid {self.grid.spec()} "
                     f"({self.grid.size} ranks, {self.device}, halos over "
                     f"{self.transport.name}), steps {self.step}->{self.total}"
                     + (", optimizer state sharded" if self._sharded else ""))

    # -- checkpoint/restart ----------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def _resume(self, chosen: Path | None = None) -> None:
        """Continue from ``chosen`` (``hpcpar run --from``), else from the newest valid
        checkpoint of the run directory."""
        path = chosen if chosen is not None else resume.choose_resumable(self.ckpt_dir, self.comm,
                                                                          log=self.log)
        if path is None:
            return
        try:
            manifest = (resume.check_chosen(path, self.grid.shape, self.job.model.kind, self.comm)
                        if chosen is not None else resume.check_compatible(path, self.grid.shape))
        except HpcparError as exc:
            raise _collective(exc) from None
        manifest, model_sd, trainer_sd, rank_sd = resume.load(
            path, resume.source_rank(manifest, self.grid.coords))
        change = resume.grid_change(manifest, self.grid.shape)
        if change is not None:      # `hpcpar run` said it already, before the ranks started
            self.log(change, echo=False)
        try:
            capture.load_full_state_dict(self.model, model_sd)
        except HpcparError as exc:
            raise _collective(exc) from None
        resume.check_optimizer(path, self.optimizer, self.job.train.optimizer,
                             trainer_sd["optimizer"])
        capture.restore_buffers(self.model, rank_sd["buffers"])
        settings = hyperparameters(self.optimizer)
        capture.load_full_optimizer_state(self.model, self.optimizer, trainer_sd["optimizer"])
        # the state is the checkpoint's, the settings the job's (its lr, betas, schedule...)
        self.scheduler = resume_settings(self.optimizer, self.job.train, self.total, settings,
                                         trainer_sd["scheduler"])
        self.history = history_rows(trainer_sd.get("history"))
        self.val_history = history_rows(trainer_sd.get("val_history"))
        self.skipped = int(trainer_sd.get("skipped_steps", 0))
        self.overflows = int(trainer_sd.get("overflow_steps", 0))
        if self.scaler is not None and "loss_scale" in trainer_sd:
            self.scaler.load_state_dict(trainer_sd["loss_scale"])
        self.workload.load_state_dict(rank_sd["data"])
        capture.set_rng_state(rank_sd["rng"])
        self.step = int(manifest["step"])
        self.resumed_from = path
        self.log(f"resumed from {path} at step {self.step}")

    def _check_steps_left(self, chosen: bool) -> None:
        """Collective: a checkpoint past the job's step count (or at it, chosen with
        ``--from``) leaves nothing to train; refused, never "done" with its training."""
        if self.resumed_from is None or (self.step == self.total and not chosen):
            return      # a resume at the last step finishes what a crash left undone
        t = self.job.train
        field = f"[train] steps = {t.steps}" if t.steps is not None else \
            f"[train] epochs = {t.epochs}"
        line = rerun.nothing_left(self.resumed_from, self.step, self.total, field)
        if line is not None:
            raise _collective(RunDirError(line))

    def _init_weights(self, path: str) -> None:
        """Collective: start this new run from plain single-process weights
        (``[train] init_from``, :mod:`hpcpar.run.init_weights`); every rank reads the file and
        all raise the first rank's error alike."""
        expected = capture.full_state_dict(self.model)
        try:
            merged, missing, unexpected = agree(self.comm, lambda: init_weights.fit_state_dict(
                init_weights.read_state_dict(path), expected, self.job.train.init_strict, path))
            capture.load_full_state_dict(self.model, merged)
        except HpcparError as exc:
            raise _collective(exc) from None
        if missing or unexpected:
            self.log(f"warning: [train] init_from {path!r}: "
                     f"{init_weights.describe_keys(missing, unexpected)}: loaded the "
                     f"{len(expected) - len(missing)} matching keys")
        self.log(f"initial weights from {path}")

    def save_checkpoint(self) -> Path:
        """Collective: checkpoint ``self.step`` (``[checkpoint] background``: a copy in memory that
        background threads write and finish, the previous one's parts written first;
        :mod:`hpcpar.run.checkpoint_writer`); raises :class:`DivergedError` (and writes
        nothing) when any rank's weights or buffers hold NaN/inf."""
        t0 = time.perf_counter()
        # a split head's full weight and state, and any copy of the model, only on the rank
        # writing each file: on every rank they would not divide by the ranks (the others
        # check their own tensors); there, backed by a file in the checkpoint directory
        size, spill = self.comm.Get_size(), self.writer.ckpt_dir
        root = store.writer("model.pt", size)
        model_state = capture.full_state_dict(self.model, root, spill,
                                           copy=self.comm.Get_rank() == root)
        buffers = capture.local_buffers(self.model)
        self._check_finite_state(model_state, buffers)
        trainer = {"optimizer": capture.full_optimizer_state(self.model, self.optimizer,
                                                          store.writer("trainer.pt", size), spill),
                   "scheduler": self.scheduler.state_dict(),
                   "history": self._packed[0](self.history),
                   "val_history": self._packed[1](self.val_history),
                   "skipped_steps": self.skipped, "overflow_steps": self.overflows}
        if self.scaler is not None:
            trainer["loss_scale"] = self.scaler.state_dict()
        rank_state = {"rng": capture.rng_state(), "data": self.workload.state_dict(),
                      "buffers": buffers}
        info = {"grid": self.grid.spec(), "epoch": self.step * self.accumulate // self.spe,
                "job": self.job.name, "kind": self.job.model.kind,
                "optimizer": self.job.train.optimizer, "time": time.time()}
        path = self.writer.save(self.step, model_state=model_state, trainer_state=trainer,
                                rank_state=rank_state, info=info)
        how = "writing in the background" if self.writer.pending is not None else "written"
        # checkpoints more frequent than the log lines are echoed only with them (a console
        # line a step with a checkpoint every step); the rank's log file has each one
        every, log_every = self.job.checkpoint.every, self.job.train.log_every
        self.log(f"checkpoint {path.name} ({how}, step blocked {time.perf_counter() - t0:.2f}s)",
                 echo=not every or every >= log_every or self.step % log_every == 0
                 or self.step == self.total)
        return path

    def _check_accumulate(self) -> None:
        """``[train] accumulate > 1`` needs a gradient sync that can wait (``no_sync()``):
        syncing every micro-batch would reduce the already reduced sum again."""
        if self.accumulate > 1 and not callable(getattr(self.wrapped, "no_sync", None)):
            raise _collective(ConfigError(
                f"{self.job.source}: [train] accumulate = {self.accumulate}: the model kind "
                f"{self.job.model.kind!r} wraps its model in {type(self.wrapped).__name__}, "
                f"which has no no_sync(); use accumulate = 1"))

    def _check_finite_state(self, model_state: dict, buffers: dict) -> None:
        """Collective: never checkpoint non-finite weights (e.g. batch-norm statistics of a NaN
        batch, which the gradient check cannot see)."""
        bad = finite.nonfinite_entries(model_state) + finite.nonfinite_entries(buffers)
        flags = self.comm.allgather(bad[0] if bad else None)
        culprits = [(r, name) for r, name in enumerate(flags) if name is not None]
        if culprits:
            r, name = culprits[0]
            raise _collective(DivergedError(
                f"diverged at step {self.step}/{self.total}: non-finite weights ({name!r} on "
                f"rank {r}); not checkpointed"))

    # -- the loop ----------------------------------------------------------------------------------
    def _sync(self) -> None:
        """The step boundary: the step's device work is done before its time is taken."""
        from hpcpar.parallel.device_sync import whole_device  # deferred: loads torch

        whole_device(self.device)

    def _agree(self, stop_flag: int, loss: float, bad_grad: bool) -> Verdict:
        """The one allreduce per step: any rank asked to stop, the mean loss over ranks, how
        many ranks saw a non-finite loss or gradient (so all ranks act alike: a NaN on one
        rank never leaves the others waiting) and, with ``clip_grad_norm``, the squared
        global gradient norm (each rank adds its share: :mod:`hpcpar.run.grad_clip`)."""
        import numpy as np
        from mpi4py import MPI

        bad_loss = not math.isfinite(loss)
        counted = self._norm_params()
        share = squared_norm(counted) if counted is not None and not bad_grad else 0.0
        buf = np.array([1.0 if stop_flag else 0.0, 0.0 if bad_loss else loss,
                        float(bad_loss), float(bad_grad), share], dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        n_bad = int(buf[2])
        return Verdict(stop=bool(buf[0] > 0),
                       mean_loss=math.nan if n_bad else float(buf[1] / self.grid.size),
                       bad_loss=n_bad, bad_grad=int(buf[3]), grad_norm=math.sqrt(buf[4]))

    def _describe_nonfinite(self, loss: float) -> str:
        """Collective (only called when some rank saw a non-finite value): which ranks and what,
        for the one-line message."""
        seen = self.comm.allgather((not math.isfinite(loss), not self._grads_ok))
        what = []
        loss_ranks = [r for r, (bl, _) in enumerate(seen) if bl]
        grad_ranks = [r for r, (_, bg) in enumerate(seen) if bg]
        if loss_ranks:
            what.append(f"non-finite loss on rank{_plural(loss_ranks)}")
        if grad_ranks:
            what.append(f"non-finite gradient on rank{_plural(grad_ranks)}")
        return " and ".join(what)

    def train_step(self, it) -> tuple[dict, float, Verdict]:
        """One optimizer step: forward and backward of each of the ``[train] accumulate``
        micro-batches of ``it`` (each loss scaled by 1/K; the gradient sync runs in the last
        backward only), the agreement allreduce, gradient clipping, then the optimizer step
        unless some rank saw a non-finite value (under fp16, the loss scale's update with that
        agreed flag). Returns (record row: phases summed over the micro-batches, local loss:
        their mean, verdict)."""
        t_start = t0 = time.perf_counter()
        before = COUNTERS.snapshot()
        t_data = t_fwd = t_bwd = 0.0
        losses, samples = [], 0
        for micro, batch in enumerate(it):
            self._sync()
            t1 = time.perf_counter()
            with self._micro_context(micro):
                with self.autocast or nullcontext():
                    res = self.workload.forward_loss(self.wrapped, batch)
                self._sync()
                t2 = time.perf_counter()
                self._backward(res.loss)
                self._sync()
            t3 = time.perf_counter()
            t_data, t_fwd, t_bwd = t_data + t1 - t0, t_fwd + t2 - t1, t_bwd + t3 - t2
            t0 = t3
            losses.append(res.loss_value if res.loss_value is not None
                          else float(res.loss.detach()))
            samples += int(res.samples)
        loss = sum(losses) / len(losses)
        self._grads_ok = self._unscaled_grads_ok()
        verdict = self._agree(self.stop.received, loss, not self._grads_ok)
        t4 = time.perf_counter()
        scale = self.scaler.scale if self.scaler is not None else None
        lr = current_lr(self.optimizer)
        if verdict.finite:
            self._clip(verdict)
            self.optimizer.step()
        if self.scaler is not None:     # the same flag on every rank: the same next scale
            verdict.overflow = not verdict.bad_loss and bool(verdict.bad_grad)
            self.scaler.update(not verdict.finite)
        if verdict.finite or verdict.overflow or self.job.train.on_nonfinite == "skip":
            self._schedule_step(stepped=verdict.finite)
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        t5 = time.perf_counter()
        t_check = self._maybe_check_replicas()

        row = row_from_counters(COUNTERS.since(before))
        exposed = row.get("t_allreduce_exposed", 0.0)
        # t_bwd excludes the exposed gradient-sync waiting the wrapper measured
        bwd = t_bwd - exposed
        row.update(step=self.step, loss=loss, t_data=t_data, t_fwd=t_fwd,
                   t_bwd=max(0.0, bwd), t_opt=t5 - t4, t_step=t5 - t_start, t_check=t_check,
                   samples=samples, peak_mem=peak_memory(self.device),
                   skipped=int(not verdict.finite), loss_scale=scale, lr=lr)
        return row, loss, verdict

    def _schedule_step(self, stepped: bool) -> None:
        """Advance the lr schedule: it follows the step index, skipped steps included, as in
        torch's AMP recipe (the scheduler steps whether or not the scaler stepped the
        optimizer). torch warns when a first step skipped ``optimizer.step()``: that is this
        choice, not a bug, so on a skipped step the warning is silenced."""
        if stepped:
            self.scheduler.step()
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before",
                                    UserWarning)
            self.scheduler.step()

    def _backward(self, loss) -> None:
        """Backward of one micro-batch's loss: scaled by 1/K with ``[train] accumulate = K``,
        and by the loss scale under fp16."""
        if self.accumulate > 1:
            loss = loss / self.accumulate
        (self.scaler.scaled(loss) if self.scaler is not None else loss).backward()

    def _unscaled_grads_ok(self) -> bool:
        """Whether this rank's synced gradients are finite, after dividing them by the fp16
        loss scale (so that clipping and the optimizer see true gradients)."""
        params = self._grad_params()
        if self.scaler is not None:
            self.scaler.unscale_(params)
        return grads_finite(params)

    def _micro_context(self, micro: int):
        """No gradient sync before the last micro-batch of an optimizer step."""
        return self.wrapped.no_sync() if micro < self.accumulate - 1 else nullcontext()

    def _clip(self, verdict: Verdict) -> None:
        """``[train] clip_grad_norm``: scale the synced gradients to the global norm's bound
        (``verdict.grad_norm``, summed in the agreement allreduce)."""
        limit = self.job.train.clip_grad_norm
        if limit:
            clip_(self._grad_params(), limit, verdict.grad_norm)

    def _grad_params(self) -> list:
        """The tensors holding this rank's synced gradients: the model's parameters, or with
        ``[train] shard_optimizer`` this rank's shard of them."""
        return self.optimizer.params if self._sharded else list(self.model.parameters())

    def _norm_params(self) -> list | None:
        """This rank's share of the global gradient norm (hpcpar.run.grad_clip); sharded: the
        pieces it holds (the sync may re-plan its buckets after the first forward); None when
        clipping is off."""
        if self._sharded and self._norm_share is not None:
            return self.optimizer.norm_params(self._norm_share)
        return self._norm_share

    def _maybe_check_replicas(self) -> float:
        """Every ``check_replicas_every`` steps: the replica check (hpcpar.sync.replicas);
        returns its cost."""
        every = self.job.train.check_replicas_every
        if not every or (self.step + 1) % every:
            return 0.0
        from hpcpar.nn.split_head import column_split  # deferred: loads torch, numpy
        from hpcpar.nn.tensor_parallel import TensorParallelLinear  # deferred: loads torch, numpy

        t0 = time.perf_counter()
        shards = frozenset(f"{m}.{n}".lstrip(".") for m, mod in self.model.named_modules()
                           if isinstance(mod, TensorParallelLinear)
                           for n, _ in mod.named_parameters(recurse=False))
        shards |= {n for n, p in self.model.named_parameters() if column_split(p) is not None}
        check_replicas(self.model, self.grid, shards)
        return time.perf_counter() - t0

    def evaluate(self, final: bool = False) -> dict:
        import torch

        self.model.eval()
        try:
            with torch.no_grad(), self.autocast or nullcontext():
                m = (self.workload.final_metrics if final else self.workload.evaluate)(self.model)
        finally:
            self.model.train()
        return {k: float(v) for k, v in (m or {}).items()}

    # -- the run: open records, loop, finish ----------------------------------------------------
    def run(self) -> TrainResult:
        """Collective: train from ``self.step`` to the end (or a stop signal); write records,
        checkpoints and, on rank 0, metrics.json."""
        recorder = self._open_recorder()
        loop = _LoopState(t_start=time.perf_counter())
        loop.bar = self._progress_bar()
        self.model.train()
        self.stop.on_abort = lambda: self._mark_aborted(recorder)
        marker = StopMarker(self.run_dir, lambda: self.step)
        self._hook("on_train_start")
        result = None
        try:
            try:
                self._loop(recorder, loop)
                if not loop.stopped:
                    self._check_trained(loop)
                    self._final_checkpoint(loop)
                self.writer.flush()
            except DivergedError as exc:
                loop.diverged = str(exc)
                self.writer.flush()     # the last finite checkpoint, if still being written
            except BaseException:
                recorder.close()
                raise
            finally:
                self.stop.on_abort = None
                self.profiler.close()
            if loop.diverged:
                return self._finish_diverged(recorder, loop)
            if loop.stopped:
                return self._finish_stopped(recorder)
            result = self._finish_ok(recorder, loop)
            return result
        finally:
            marker.close()
            self._hook("on_train_end", result.metrics if result is not None else {})

    def _check_trained(self, loop: _LoopState) -> None:
        """Collective: a run that trained on nothing never ends "ok". Every step skipped for
        non-finite values is a divergence; steps that used no sample (or vertex) are an error
        naming the count."""
        if not loop.steps_done:
            return
        if self.skipped + self.overflows >= self.step:
            why = (f"{self.overflows} for fp16 gradient overflow" if self.overflows
                   else '[train] on_nonfinite = "skip"')
            raise _collective(DivergedError(
                f"diverged: all {self.step} optimizer steps were skipped for non-finite values "
                f"({why}): nothing was trained"))
        if not self.comm.allreduce(loop.samples_done):
            raise _collective(DataError(
                f"{self.job.model.kind}: {loop.steps_done} steps used no training sample or "
                f"vertex: nothing was trained (check [data] and the training mask)"))

    def _hook(self, name: str, *args) -> None:
        """Call ``name`` on every callback (hpcpar.run.callbacks.Callback)."""
        for cb in self.callbacks:
            getattr(cb, name)(self, *args)

    def _open_recorder(self):
        job = self.job
        resume = self.step > 0 or (self.run_dir / "meta.json").exists()
        recorder = RunRecorder(self.run_dir, self.grid, resume=resume, meta={
            "job_name": job.name, "job": job.to_dict(), "job_file": job.source,
            "global_batch": job.train.global_batch, "kind": job.model.kind,
            "device": str(self.device), "halo_transport": self.transport.name,
            **self.workload.run_meta(),
            # rank 0 writes meta.json: only it reads the data to checksum it
            **({"data": data_identity(job)} if self.rank == 0 else {})})
        if self.rank == 0:      # what the launcher reports: the step the ranks really resumed
            where = ({"resumed_from": self.resumed_from.name, "resumed_step": self.step}
                     if self.resumed_from is not None else {"resumed_from": None})
            recorder.update_meta(lambda m: m["segments"][-1].update(where))
        return recorder

    def _mark_aborted(self, recorder) -> None:
        """Second Ctrl-C: leave meta.json saying how the run ended, not "running"."""
        if self.rank == 0:
            try:
                recorder.update_meta(lambda m: m.update(status="failed", end_reason="interrupted"))
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass

    def _progress_bar(self):
        """A tqdm bar on rank 0 when ``HPCPAR_PROGRESS=1`` (set by ``hpcpar run`` on a tty)."""
        if self.rank != 0 or not _env.get("HPCPAR_PROGRESS"):
            return None
        from tqdm import tqdm

        self.log.bar = tqdm(total=self.total, initial=self.step, unit="step",
                            dynamic_ncols=True, file=sys.stderr, leave=False)
        return self.log.bar

    def _loop(self, recorder, loop: _LoopState) -> None:
        """Steps until the end or an agreed stop; ``loop`` carries what the finish needs."""
        while self.step < self.total:
            it = self._batches(loop)
            self.profiler.before_step(self.step + 1)
            row, loss, verdict = self.train_step(it)
            self.step += 1
            self.profiler.after_step(self.step)
            loop.steps_done += 1
            loop.samples_done += row["samples"]
            loop.mean_loss = verdict.mean_loss
            loop.grad_norm = verdict.grad_norm
            try:        # the row is recorded with its checkpoint cost, whatever happens
                if verdict.overflow:
                    self._on_overflow(loss)
                elif not verdict.finite:
                    self._on_nonfinite(verdict, loss)
                loop.stopped = verdict.stop and self.step < self.total   # done anyway: finish
                if loop.bar is not None:
                    loop.bar.update(1)
                    loop.bar.set_postfix(loss=f"{loop.mean_loss:.4g}")
                self._log_step(row, loop)
                self._hook("on_step_end", row, verdict.mean_loss)
                self._maybe_validate()
                row["t_ckpt"] = self._maybe_checkpoint(loop)
            finally:
                recorder.step(**row)
            if loop.stopped:
                why = (StopRequest.name(self.stop.received) if self.stop.received
                       else "another rank")
                self.log(f"stop signal ({why}): checkpointed at step {self.step}, "
                         f"exit {EXIT_REQUEUE} to requeue")
                return

    def _on_nonfinite(self, verdict: Verdict, loss: float) -> None:
        """Collective: stop (raise :class:`DivergedError`) or count a skipped step."""
        what = self._describe_nonfinite(loss)
        if self.job.train.on_nonfinite == "skip":
            self.skipped += 1
            self.log(f"step {self.step}/{self.total}: {what}: optimizer step skipped "
                     f"({self.skipped} skipped so far)")
            return
        raise _collective(DivergedError(f"diverged at step {self.step}/{self.total}: {what}"))

    def _on_overflow(self, loss: float) -> None:
        """Collective: fp16 gradients overflowed on some rank (every loss finite): the step
        was skipped everywhere and the scale backed off; log it, or raise
        :class:`DivergedError` once the scale no longer explains it
        (:data:`hpcpar.run.loss_scale.MIN_SCALE`)."""
        what = self._describe_nonfinite(loss)
        assert self.scaler is not None  # only fp16 runs overflow
        self.overflows += 1
        used = self.scaler.scale / self.scaler.backoff_factor
        if self.scaler.exhausted:
            raise _collective(DivergedError(
                f"diverged at step {self.step}/{self.total}: {what} even at fp16 loss scale "
                f"{used:g} ({self.overflows} overflows)"))
        self.log(f"step {self.step}/{self.total}: {what}: fp16 overflow at loss scale "
                 f"{used:g}: optimizer step skipped, scale now {self.scaler.scale:g}")

    def _batches(self, loop: _LoopState):
        """The ``[train] accumulate`` batches of the next optimizer step, each from its
        epoch's iterator (a new one at each epoch start: an epoch may end inside a step)."""
        first = self.step * self.accumulate
        for micro in range(first, first + self.accumulate):
            epoch = micro // self.spe
            if epoch != loop.epoch or loop.it is None:
                loop.epoch = epoch
                loop.it = iter(self.workload.batches(epoch))
            yield next(loop.it)

    def _log_step(self, row: dict, loop: _LoopState) -> None:
        """Every ``log_every`` steps (and the first and last): the window's mean loss into the
        history and one log line."""
        if loop.mean_loss == loop.mean_loss:      # a skipped non-finite step has no loss
            loop.window.append(loop.mean_loss)
        if not loop.window or not (self.step % self.job.train.log_every == 0
                                   or self.step in (1, self.total)):
            return
        smooth = sum(loop.window) / len(loop.window)
        loop.window.clear()
        self.history.append([self.step, smooth])
        rate = row["samples"] / max(row["t_step"], 1e-12)
        norm = (f"grad norm {loop.grad_norm:.4g} " if self.job.train.clip_grad_norm else "")
        self.log(f"step {self.step}/{self.total} loss {smooth:.5g} {norm}"
                 f"lr {self.scheduler.get_last_lr()[0]:.3g} "
                 f"step {row['t_step'] * 1e3:.1f}ms ({rate:.1f} samples/s/replica)")

    def _maybe_validate(self) -> None:
        every = self.job.train.val_every
        if not (every and self.step % every == 0 and self.step < self.total):
            return
        metrics = self.evaluate()
        self._hook("on_validation", metrics)
        self.val_history.append({"step": self.step, **metrics})
        self.log(f"validation at step {self.step}: " + ", ".join(
            f"{k} {v:.5g}" for k, v in metrics.items()))

    def _maybe_checkpoint(self, loop: _LoopState) -> float:
        """Collective, at every step boundary: checkpoint when due; commit a background write
        once every rank finished it; before a stop or after the last step, wait for it.
        Returns the seconds the step blocked (the ``t_ckpt`` record)."""
        t0 = time.perf_counter()
        every = self.job.checkpoint.every
        saved = loop.stopped or (every and self.step % every == 0)
        if saved:
            loop.last_ckpt = self.save_checkpoint()
        if loop.stopped or self.step >= self.total:
            self.writer.flush()
        elif not saved:   # the writes just began: asking whether they ended costs a collective
            self.writer.poll()
        return time.perf_counter() - t0

    def _final_checkpoint(self, loop: _LoopState) -> None:
        if self.job.checkpoint.at_end and loop.steps_done and (
                loop.last_ckpt is None or not loop.last_ckpt.name.endswith(f"{self.step:06d}")):
            loop.last_ckpt = self.save_checkpoint()

    def _finish_stopped(self, recorder) -> TrainResult:
        why = StopRequest.name(self.stop.received) if self.stop.received else "another rank"
        recorder.finish("preempted", f"stopped by a signal ({why}) after checkpointing step "
                                     f"{self.step}")
        self.log.close()
        return TrainResult(self.step, stopped=True, skipped_steps=self.skipped,
                           overflow_steps=self.overflows)

    def _finish_diverged(self, recorder, loop: _LoopState):
        """Collective: records merged, meta.json status "diverged" with the reason, no new
        checkpoint (the newest one holds the last finite weights); raises DivergedError."""
        newest = store.list_checkpoints(self.ckpt_dir)
        kept = (f"; last finite checkpoint {newest[0].name} kept" if newest
                else "; no checkpoint had been written yet")
        reason = (loop.diverged or "") + kept
        recorder.finish("diverged", reason)
        if self.rank == 0:
            recorder.update_meta(lambda m: m.update(
                diverged={"step": self.step, "reason": reason}, skipped_steps=self.skipped))
        self.log(reason, echo=False)       # rank 0 prints it once as the error line
        self.log.close()
        raise _collective(DivergedError(reason))

    def _finish_ok(self, recorder, loop: _LoopState) -> TrainResult:
        """Final metrics, records merged, metrics.json on rank 0."""
        out = self._final_metrics(loop)
        self._hook("on_validation", {k: v for k, v in out.items()
                                     if k.startswith(("val_", "test_")) and isinstance(v, float)})
        recorder.finish("ok")
        if self.rank == 0:
            if self.skipped:
                recorder.update_meta(lambda m: m.update(skipped_steps=self.skipped))
            write_json_atomic(self.run_dir / "metrics.json", out)
            self.log("done: " + ", ".join(f"{k} {v:.5g}" for k, v in out.items()
                                          if isinstance(v, float)))
        self.log.close()
        return TrainResult(self.step, metrics=out, skipped_steps=self.skipped,
                           overflow_steps=self.overflows)

    def _final_metrics(self, loop: _LoopState) -> dict:
        """Collective: the metrics.json contents (final evaluation included)."""
        metrics = self.evaluate(final=True)
        wall = time.perf_counter() - loop.t_start
        total_samples = self.comm.allreduce(loop.samples_done) / max(1, self.grid.spatial_size)
        return {"final_train_loss": self.history[-1][1] if self.history else None,
                "last_step_loss": loop.mean_loss if loop.steps_done
                and math.isfinite(loop.mean_loss) else None,
                "steps": self.step, "epochs": self.step * self.accumulate / self.spe,
                "wall_time_s": wall, "samples_per_s": total_samples / wall if wall > 0 else None,
                "train_loss_history": self.history, "validation_history": self.val_history,
                "skipped_steps": self.skipped, "overflow_steps": self.overflows, **metrics}

    def close(self) -> None:
        self.transport.close()
        self.workload.close()


class StopMarker:
    """Records in meta.json, the moment a stop signal arrives, that the run is stopping
    (status "preempted", no end time yet; the loop's own ending replaces it). A thread does it,
    woken through ``signal.set_wakeup_fd``: a rank blocked in MPI (a node lost, a peer gone)
    runs no Python signal handler, and Slurm's SIGKILL follows its SIGTERM. Every rank marks,
    since the signalled ranks may not include rank 0."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self, run_dir: Path, step: Callable[[], int]):
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(Path(run_dir), step),
                                        name="hpcpar-stop-marker", daemon=True)
        self._thread.start()

    def _watch(self, run_dir: Path, step: Callable[[], int]) -> None:
        while data := os.read(self._read, 64):
            sig = next((s for s in data if s in self.SIGNALS), None)
            if sig is not None:
                rundir.mark_ended(run_dir, f"{StopRequest.name(sig)} received during step "
                                           f"{step() + 1}: stopping after it with a checkpoint",
                                  status="preempted", final=False)
                return

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        os.close(self._write)           # the watcher reads end-of-file and returns
        self._thread.join(timeout=5)
        os.close(self._read)


def failure_reason(exc: BaseException, rank: int) -> str:
    """The one-line ``end_reason`` of a run ended by ``exc``: an error every rank raised alike
    names no rank."""
    if isinstance(exc, HpcparError):
        text = str(exc)
    else:
        text = f"crash: {type(exc).__name__}: {str(exc).strip()}"
    text = (text.splitlines() or [""])[0]
    return text if getattr(exc, "collective", False) else f"[rank {rank}] {text}"


def train(job: JobSpec, run_dir: str | os.PathLike, *, resume: bool = True,
          comm: MPI.Comm | None = None, device: torch.device | str | None = None,
          callbacks: list | None = None,
          start_from: str | os.PathLike | None = None) -> TrainResult:
    """Train ``job`` into ``run_dir`` on every rank of ``comm`` (collective).

    Builds the grid, the workload's model and data, the optimizer and schedule; trains with
    per-step records of every rank, checkpoints, and resumes exactly from the last
    checkpoint. SIGUSR1/SIGTERM/SIGINT are caught from the start (a signal during set-up stops
    after the first step) to the end of this call: every rank stops after the same step and
    checkpoints; a second SIGINT exits at once (code 130).

    ``job`` is a validated job (``hpcpar.formats.jobspec.load_job``); ``run_dir`` holds the
    records, checkpoints and logs. ``resume``: continue from its last checkpoint when there is
    one; ``start_from``: from this checkpoint directory instead (of this run or another; it
    must verify and fit the job and grid). ``comm`` None is ``MPI.COMM_WORLD``; ``device`` None
    is chosen from the job and the machine. ``callbacks`` (``hpcpar.run.callbacks.Callback``)
    run after the job's own (``[output] tensorboard``/``callbacks``).

    Returns a [TrainResult][hpcpar.run.trainer.TrainResult]. Raises DivergedError when the loss
    or gradients became non-finite (``on_nonfinite = "stop"``), HpcparError on a user error
    (job, run directory, incompatible checkpoint), alike on every rank.

    Example:
        ```python
        job = load_job("jobs/demo-cosmoflow.toml", ["train.steps=10"])
        result = train(job, "runs/api-demo")     # under mpiexec -n 4
        ```
    """
    stop = StopRequest().install()
    try:
        trainer = Trainer(job, run_dir, resume=resume, comm=comm, device=device, stop=stop,
                          callbacks=callbacks, start_from=start_from)
        try:
            return trainer.run()
        finally:
            trainer.close()
    except BaseException as exc:
        _record_failure(job, run_dir, exc, comm)
        raise
    finally:
        stop.uninstall()


def _record_failure(job: JobSpec, run_dir, exc: BaseException, comm) -> None:
    """meta.json says "failed" with the reason after any error (rank 0 writes an error all
    ranks raised; a rank failing alone writes its own, as the others may never learn of it).
    A run that failed before its records started (making its dataset on a full disk, say) gets
    a meta.json too. A diverged run has recorded its status already."""
    from mpi4py import MPI

    rank = (comm or MPI.COMM_WORLD).Get_rank()
    if getattr(exc, "collective", False) and rank != 0:
        return
    rundir.mark_ended(run_dir, failure_reason(exc, rank), job=job.to_dict())


def _collective(exc: Exception) -> Exception:
    """Mark an error raised alike on every rank: the ranks print it once, not once each."""
    exc.collective = True  # type: ignore[attr-defined]  # any exception may carry the mark
    return exc


def _plural(ranks: list[int]) -> str:
    return f" {ranks[0]}" if len(ranks) == 1 else f"s {', '.join(map(str, ranks))}"


def _printed_by_root(msg: str, timeout: float = 10.0) -> None:
    """An error every rank raised alike: rank 0 prints it, then all ranks leave together. A
    rank that exited first would let the launcher kill rank 0 before its line is out (the
    run then ends with the error's exit code and no message). Bounded: a rank that is not
    there after ``timeout`` seconds is not waited for."""
    from mpi4py import MPI

    if msg:
        print(msg, file=sys.stderr, flush=True)
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    req = MPI.COMM_WORLD.Ibarrier()
    end = time.monotonic() + timeout
    while not req.Test() and time.monotonic() < end:
        time.sleep(0.005)


def _die(code: int, msg: str, on_exit=None) -> None:
    """Exit this rank at once, skipping MPI_Finalize: a rank failing alone must not hang in
    finalize; mpiexec/srun then stop the others with this code. ``on_exit`` runs first (e.g.
    releasing the run directory's lock when the CLI runs in-process)."""
    if on_exit is not None:
        on_exit()
    sys.stdout.flush()
    if msg:
        print(msg, file=sys.stderr, flush=True)
    os._exit(code)


def main(argv: Sequence[str] | None = None,
         on_exit: Callable[[], object] | None = None) -> int:
    """Per-rank entry point: train the resolved job (``argv``: job JSON, ``--run-dir``,
    ``--[no-]resume``, ``--from CHECKPOINT``; None reads ``sys.argv``) in the run directory;
    ``EXIT_OK`` when the run finished. Errors end the process (``os._exit``, after ``on_exit``)
    with the exit codes of :mod:`hpcpar.errors`; a run stopped by a signal exits with
    ``EXIT_REQUEUE``."""
    ap = argparse.ArgumentParser(prog="python -m hpcpar.run.trainer")
    ap.add_argument("job_json")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume", dest="resume", action="store_true", default=True)
    ap.add_argument("--no-resume", dest="resume", action="store_false")
    ap.add_argument("--from", dest="start_from", default=None)
    args = ap.parse_args(argv)

    rank = rank_info().rank
    try:
        job = load_resolved(args.job_json)
        result = train(job, args.run_dir, resume=args.resume, start_from=args.start_from)
    except HpcparError as exc:
        # an error every rank raised alike is printed once (rank 0), naming no rank
        collective = getattr(exc, "collective", False)
        msg = (f"hpcpar: error: {exc}" if rank == 0 else "") if collective else \
            f"hpcpar: error: [rank {rank}] {exc}"
        if collective:
            _printed_by_root(msg)
            msg = ""
        _die(getattr(exc, "exit_code", EXIT_USAGE), msg, on_exit)
    except BaseException:  # noqa: BLE001 - any crash: report with the rank, stop everyone
        _die(EXIT_FAILED, "".join(f"[rank {rank}] {line}\n" for line in
                                  traceback.format_exc().splitlines()), on_exit)
    if result.stopped:
        _die(EXIT_REQUEUE, "", on_exit)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
