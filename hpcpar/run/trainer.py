"""The training loop every rank runs: grid -> workload (reader + model) -> optimizer -> gradient
sync -> timed steps, with records, validation, checkpoints and the stop-signal contract.

Run by ``hpcpar run`` as ``python -m hpcpar.run.trainer RUN/job.json --run-dir RUN [--resume]`` on
every rank, or in-process with :func:`train`. Each step is timed per phase (data wait, forward,
backward, exposed allreduce, optimizer; halo and allreduce totals come from
``hpcpar.parallel.counters.COUNTERS``) and recorded through :class:`hpcpar.run.records.RunRecorder`.
At the end of every step one small allreduce gives all ranks the mean loss and whether any rank
got SIGUSR1/SIGTERM, so all ranks stop, checkpoint and exit 3 after the same step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hpcpar.run import checkpoint as ckpt
from hpcpar.errors import HpcparError
from hpcpar.run.signals import EXIT_FAILED, EXIT_OK, EXIT_REQUEUE, EXIT_USAGE, StopRequest


@dataclass
class TrainResult:
    step: int                       # steps completed
    stopped: bool = False           # True: stopped by a signal after checkpointing
    metrics: dict = field(default_factory=dict)


class RankLog:
    """Per-rank log file ``RUN/logs/rank-00003.log`` (lines prefixed ``[rank 3]``); rank 0 also
    echoes to stderr, through the tqdm bar when one is shown."""

    def __init__(self, run_dir: Path, rank: int, echo: bool):
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.prefix = f"[rank {rank}]"
        self.file = open(run_dir / "logs" / f"rank-{rank:05d}.log", "a", buffering=1)
        self.echo = echo
        self.bar = None

    def __call__(self, msg: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.file.write(f"{stamp} {self.prefix} {msg}\n")
        if self.echo:
            if self.bar is not None:
                self.bar.write(f"hpcpar {msg}", file=sys.stderr)
            else:
                print(f"hpcpar {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()


def seed_all(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def peak_memory(device) -> float:
    """Peak bytes: CUDA max allocated on a GPU, else this process's max RSS."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


def total_steps(job, steps_per_epoch: int) -> int:
    t = job.train
    return int(t.steps) if t.steps is not None else int(t.epochs) * int(steps_per_epoch)


class Trainer:
    """One rank's training run; construction is collective (grid, model, resume)."""

    def __init__(self, job, run_dir, *, resume: bool = True, comm=None, device=None,
                 stop: StopRequest | None = None):
        import torch

        from hpcpar.parallel.grid import ProcessGrid
        from hpcpar.parallel.placement import select_device
        from hpcpar.run._optim import build_optimizer, build_scheduler
        from hpcpar.run.workloads.base import get_workload

        self.job = job
        self.run_dir = Path(run_dir)
        self.grid = ProcessGrid(*job.grid_shape, comm=comm)
        self.comm = self.grid.comm
        self.rank = self.grid.rank
        self.stop = stop if stop is not None else StopRequest()
        self.device = device if device is not None else select_device()
        self.log = RankLog(self.run_dir, self.rank, echo=self.rank == 0)
        seed_all(job.train.seed)
        self.workload = get_workload(job.model.kind)(job, self.grid, self.device)
        self.model = self.workload.build_model()
        self.spe = int(self.workload.steps_per_epoch())
        self.total = total_steps(job, self.spe)
        self.optimizer = build_optimizer(job.train, self.workload.param_groups(self.model))
        self.scheduler = build_scheduler(self.optimizer, job.train, self.total)
        self.wrapped = self.workload.wrap(self.model)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                         if job.train.precision == "bf16" else None)
        self.step = 0
        self.history: list[list] = []      # [step, mean loss] at log points
        self.val_history: list[dict] = []
        if resume:
            self._resume()
        if self.rank == 0:
            self.log(f"{job.name}: {job.model.kind} on grid {self.grid.spec()} "
                     f"({self.grid.size} ranks, {self.device}), steps {self.step}->{self.total}")

    # -- checkpoint/restart ----------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def _resume(self) -> None:
        path = ckpt.find_resumable(self.ckpt_dir, self.comm, log=self.log)
        if path is None:
            return
        manifest = ckpt.check_compatible(path, self.grid.size, self.grid.spec())
        manifest, model_sd, trainer_sd, rank_sd = ckpt.load(path, self.rank)
        ckpt.load_full_state_dict(self.model, model_sd)
        import torch

        with torch.no_grad():
            for name, buf in self.model.named_buffers():
                if name in rank_sd["buffers"]:
                    buf.copy_(rank_sd["buffers"][name])
        self.optimizer.load_state_dict(trainer_sd["optimizer"])
        self.scheduler.load_state_dict(trainer_sd["scheduler"])
        self.history = [list(h) for h in trainer_sd.get("history", [])]
        self.val_history = list(trainer_sd.get("val_history", []))
        self.workload.load_state_dict(rank_sd["data"])
        ckpt.set_rng_state(rank_sd["rng"])
        self.step = int(manifest["step"])
        self.log(f"resumed from {path} at step {self.step}")

    def save_checkpoint(self) -> Path:
        t0 = time.perf_counter()
        trainer = {"optimizer": self.optimizer.state_dict(),
                   "scheduler": self.scheduler.state_dict(),
                   "history": self.history, "val_history": self.val_history}
        rank_state = {"rng": ckpt.rng_state(), "data": self.workload.state_dict(),
                      "buffers": ckpt.local_buffers(self.model)}
        info = {"grid": self.grid.spec(), "epoch": self.step // self.spe,
                "job": self.job.name, "kind": self.job.model.kind, "time": time.time()}
        path = ckpt.save(self.ckpt_dir, self.step, comm=self.comm,
                         model_state=ckpt.full_state_dict(self.model), trainer_state=trainer,
                         rank_state=rank_state, info=info, keep=self.job.checkpoint.keep)
        self.log(f"checkpoint {path.name} ({time.perf_counter() - t0:.2f}s)")
        return path

    # -- the loop ----------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def _agree(self, stop_flag: int, loss: float) -> tuple[bool, float]:
        """One allreduce per step: (any rank asked to stop, mean loss over ranks)."""
        import numpy as np
        from mpi4py import MPI

        buf = np.array([1.0 if stop_flag else 0.0, loss], dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return bool(buf[0] > 0), float(buf[1] / self.grid.size)

    def train_step(self, it) -> tuple[dict, float]:
        """One optimizer step; returns (record row, local loss)."""
        from hpcpar.parallel.counters import COUNTERS

        t0 = time.perf_counter()
        before = COUNTERS.snapshot()
        batch = next(it)
        self._sync()
        t1 = time.perf_counter()
        if self.autocast is not None:
            with self.autocast:
                res = self.workload.forward_loss(self.wrapped, batch)
        else:
            res = self.workload.forward_loss(self.wrapped, batch)
        self._sync()
        t2 = time.perf_counter()
        res.loss.backward()
        finish = getattr(self.wrapped, "finish_gradient_sync", None)
        self._sync()
        t3 = time.perf_counter()
        if callable(finish):
            finish()
            self._sync()
        t4 = time.perf_counter()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        t5 = time.perf_counter()
        from hpcpar.run.records import row_from_counters

        row = row_from_counters(COUNTERS.since(before))
        exposed = row.get("t_allreduce_exposed", 0.0)
        loss = res.loss_value if res.loss_value is not None else float(res.loss.detach())
        # t_bwd excludes exposed gradient-sync waiting, wherever the wrapper measured it
        bwd = (t3 - t2) - (exposed if not callable(finish) else 0.0)
        row.update(step=self.step, loss=loss, t_data=t1 - t0, t_fwd=t2 - t1,
                   t_bwd=max(0.0, bwd), t_opt=t5 - t4, t_step=t5 - t0,
                   samples=int(res.samples), peak_mem=peak_memory(self.device))
        if callable(finish):
            row["t_allreduce_exposed"] = exposed + (t4 - t3)
        return row, loss

    def evaluate(self, final: bool = False) -> dict:
        import torch

        self.model.eval()
        try:
            with torch.no_grad():
                if self.autocast is not None:
                    with self.autocast:
                        m = (self.workload.final_metrics if final else
                             self.workload.evaluate)(self.model)
                else:
                    m = (self.workload.final_metrics if final else self.workload.evaluate)(
                        self.model)
        finally:
            self.model.train()
        return {k: float(v) for k, v in (m or {}).items()}

    def run(self) -> TrainResult:
        from hpcpar.run.records import RunRecorder

        job = self.job
        recorder = RunRecorder(self.run_dir, self.grid, resume=self.step > 0 or (
            self.run_dir / "meta.json").exists(), meta={
            "job_name": job.name, "job": job.to_dict(), "job_file": job.source,
            "global_batch": job.train.global_batch, "kind": job.model.kind,
            "device": str(self.device)})
        bar = None
        if self.rank == 0 and os.environ.get("HPCPAR_PROGRESS", "") == "1":
            from tqdm import tqdm

            bar = self.log.bar = tqdm(total=self.total, initial=self.step, unit="step",
                                      dynamic_ncols=True, file=sys.stderr, leave=False)
        stop = self.stop
        self.model.train()
        t_start, steps_done, samples_done = time.perf_counter(), 0, 0
        last_ckpt, mean_loss, stopped, it, epoch = None, float("nan"), False, None, None
        window: list[float] = []          # mean losses since the last log line
        try:
            while self.step < self.total:
                if self.step // self.spe != epoch or it is None:
                    epoch = self.step // self.spe
                    it = iter(self.workload.batches(epoch))
                row, loss = self.train_step(it)
                recorder.step(**row)
                self.step += 1
                steps_done += 1
                samples_done += row["samples"]
                stopped, mean_loss = self._agree(stop.received, loss)
                stopped = stopped and self.step < self.total   # done anyway: finish normally
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{mean_loss:.4g}")
                window.append(mean_loss)
                if self.step % job.train.log_every == 0 or self.step in (1, self.total):
                    smooth = sum(window) / len(window)
                    window.clear()
                    self.history.append([self.step, smooth])
                    rate = row["samples"] / max(row["t_step"], 1e-12)
                    self.log(f"step {self.step}/{self.total} loss {smooth:.5g} "
                             f"lr {self.scheduler.get_last_lr()[0]:.3g} "
                             f"step {row['t_step'] * 1e3:.1f}ms ({rate:.1f} samples/s/replica)")
                if job.train.val_every and self.step % job.train.val_every == 0 \
                        and self.step < self.total:
                    metrics = self.evaluate()
                    self.val_history.append({"step": self.step, **metrics})
                    self.log(f"validation at step {self.step}: " + ", ".join(
                        f"{k} {v:.5g}" for k, v in metrics.items()))
                every = job.checkpoint.every
                if stopped or (every and self.step % every == 0):
                    last_ckpt = self.save_checkpoint()
                if stopped:
                    why = StopRequest.name(stop.received) if stop.received else "another rank"
                    self.log(f"stop signal ({why}): checkpointed at step {self.step}, "
                             f"exit {EXIT_REQUEUE} to requeue")
                    break
        except BaseException:
            recorder.close()
            raise
        if stopped:
            recorder.finish("preempted")
            self.log.close()
            return TrainResult(self.step, stopped=True)
        if job.checkpoint.at_end and (last_ckpt is None or not last_ckpt.name.endswith(
                f"{self.step:06d}")) and steps_done:
            self.save_checkpoint()
        metrics = self.evaluate(final=True)
        wall = time.perf_counter() - t_start
        total_samples = self.comm.allreduce(samples_done) / max(1, self.grid.spatial_size)
        out = {"final_train_loss": self.history[-1][1] if self.history else None,
               "last_step_loss": mean_loss if steps_done else None,
               "steps": self.step, "epochs": self.step / self.spe,
               "wall_time_s": wall, "samples_per_s": total_samples / wall if wall > 0 else None,
               "train_loss_history": self.history, "validation_history": self.val_history,
               **metrics}
        recorder.finish("ok")
        if self.rank == 0:
            from hpcpar.run.records import write_json_atomic

            write_json_atomic(self.run_dir / "metrics.json", out)
            self.log("done: " + ", ".join(f"{k} {v:.5g}" for k, v in out.items()
                                          if isinstance(v, float)))
        self.log.close()
        return TrainResult(self.step, metrics=out)

    def close(self) -> None:
        self.workload.close()


def train(job, run_dir, *, resume: bool = True, comm=None, device=None) -> TrainResult:
    """Collective: train ``job`` (a :class:`hpcpar.run.jobspec.JobSpec`) into ``run_dir``.

    SIGUSR1/SIGTERM are caught from the start (a signal during set-up stops after the first
    step) to the end of this call."""
    stop = StopRequest().install()
    try:
        trainer = Trainer(job, run_dir, resume=resume, comm=comm, device=device, stop=stop)
        try:
            return trainer.run()
        finally:
            trainer.close()
    finally:
        stop.uninstall()


def _die(code: int, msg: str) -> None:
    """Exit this rank at once, skipping MPI_Finalize: a rank failing alone must not hang in
    finalize; mpiexec/srun then stop the others with this code."""
    sys.stdout.flush()
    if msg:
        print(msg, file=sys.stderr, flush=True)
    os._exit(code)


def main(argv=None) -> int:
    """Per-rank entry point; exit codes as in :mod:`hpcpar.run.signals`."""
    ap = argparse.ArgumentParser(prog="python -m hpcpar.run.trainer")
    ap.add_argument("job_json")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume", dest="resume", action="store_true", default=True)
    ap.add_argument("--no-resume", dest="resume", action="store_false")
    args = ap.parse_args(argv)
    from hpcpar.parallel.placement import rank_info

    rank = rank_info().rank
    try:
        from hpcpar.run.jobspec import load_resolved

        job = load_resolved(args.job_json)
        result = train(job, args.run_dir, resume=args.resume)
    except HpcparError as exc:
        _die(getattr(exc, "exit_code", EXIT_USAGE), f"hpcpar: error: [rank {rank}] {exc}")
    except BaseException:  # noqa: BLE001 - any crash: report with the rank, stop everyone
        _die(EXIT_FAILED, "".join(f"[rank {rank}] {line}\n" for line in
                                  traceback.format_exc().splitlines()))
    if result.stopped:
        _die(EXIT_REQUEUE, "")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
