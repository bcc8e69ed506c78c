"""The trainer: a YAML config in, a trained model, metrics, traces and checkpoints out.

    config ──> build model (seeded) ──> device mesh ──> replacement plan (validated, then
    applied, outputs checked; MegaMoE gets the expert-parallel group) ──> parallel set-up
    (TP, CP, recomputation, FSDP2) ──> optimizer
    ──> for each step: for each micro-batch: batch(step, data rank) -> this rank's part
        -> forward -> loss -> backward;  then grad sync -> clip -> lr(step) -> optimizer step
        -> metrics (loss, tokens/s, peak memory, MFU, comm time) / progress / trace / checkpoint

Every random choice is derived from ``run.seed`` and the step number, so a run that
stops after step k and resumes from its checkpoint reproduces the losses of an
uninterrupted run exactly.
"""
from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.graphs.common.runner import GraphRunner
from megaloom.models.hf_moe import build_model
from megaloom.runtime.errors import ConfigError
from megaloom.runtime.perfetto import write_chrome
from megaloom.train import checkpoint as ckpt
from megaloom.train.config import Config
from megaloom.train.data import make_stream
from megaloom.train.flops import flops_per_token, peak_flops
from megaloom.train.optim import make_optimizer
from megaloom.train.parallel import mesh as meshes
from megaloom.train.parallel.clock import CommClock, TimedCommunicator
from megaloom.train.parallel.context import split
from megaloom.train.progress import MetricsLog, Progress, peak_memory_mib, reset_peak_memory
from megaloom.train.step_trace import StepTracer


@dataclass(slots=True)
class StepRecord:
    """What one optimizer step produced: loss averaged over every rank's tokens, tokens of all data ranks,
    this rank's peak memory (MiB), comm time (s with a collective in flight) and MFU (None: no hardware profile)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    tokens_per_s: float
    peak_mem_mib: float
    comm_s: float
    mfu: float | None
    time_s: float

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def lr_factor(step: int, sched: dict) -> float:
    """Multiplier of the peak lr for 0-based ``step``: linear warm-up, then constant / linear / cosine decay."""
    warm, total, floor = sched["warmup_steps"], sched["steps"], sched["min_lr_ratio"]
    if step < warm:
        return (step + 1) / warm
    if sched["decay"] == "constant":
        return 1.0
    p = min(1.0, (step - warm) / max(1, total - warm))
    shape = 1.0 - p if sched["decay"] == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return floor + (1.0 - floor) * shape


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``tokens [B, S+1]`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    return lm_loss(model, *split(tokens, 0, 1))


def lm_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross entropy of ``model``'s logits for ``inputs`` against ``labels`` (part of a sequence: ``positions``)."""
    logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class Trainer:
    """Builds everything a config describes; :meth:`fit` runs the remaining steps.

    ``comm`` is a megaloom Communicator (tests pass one from ``megaloom.comm.spawn``);
    by default it is a TorchCommunicator under torchrun (``WORLD_SIZE`` > 1), else local.
    """

    def __init__(self, cfg: Config, comm: Any = None, log=None):
        self.cfg, self.log = cfg, log or (lambda msg: None)
        self.comm = comm if comm is not None else _default_comm(cfg["parallel"])
        self.rank, self.world = self.comm.rank, self.comm.world_size
        run = cfg["run"]
        self.ckpt_dir = cfg["checkpoint"]["dir"] or os.path.join(run["out_dir"], "checkpoints")
        self.trace_dir = cfg["trace"]["dir"] or os.path.join(run["out_dir"], "traces")
        for key, path in (("run.out_dir", run["out_dir"]), ("checkpoint.dir", self.ckpt_dir),
                          ("trace.dir", self.trace_dir if cfg["trace"]["steps"] else None)):
            _writable_dir(key, path)  # before any work, not at the first save
        self.seed = run["seed"]
        par = cfg["parallel"]
        self.dims = meshes.MeshDims.of(par, self.world)
        self.accum = cfg["optimizer"]["grad_accum_steps"]
        self.clock = CommClock()
        self.base_model = build_model(cfg["model"], self.seed)
        self.vocab = int(self.base_model.config.vocab_size)
        self.flops_per_token = flops_per_token(self.base_model, cfg["data"]["seq_len"])
        self.peak_flops = self._peak_flops()
        self.data = make_stream(cfg["data"], self.vocab, self.seed)
        self.mesh = meshes.build(self.dims, self.comm, par["backend"], lambda c: TimedCommunicator(c, self.clock))
        self.swaps = self._apply_plan()
        self.parallel = _setup_parallel(self.base_model, par, self.mesh.world or TimedCommunicator(self.comm, self.clock),
                                        self.mesh, self.clock, self.log, self._probe)
        self.model = self.parallel.model  # the base model (FSDP2 and TP convert its modules in place)
        self.optimizer = make_optimizer(self.model, cfg["optimizer"])
        self.step = 0
        resume_from = ckpt.find(cfg["checkpoint"]["resume"], self.ckpt_dir)
        if resume_from is not None:
            self._load(resume_from)
        self.tracer = StepTracer(self.base_model, self.rank, self.world) if cfg["trace"]["steps"] else None
        self.metrics = MetricsLog(os.path.join(run["out_dir"], "metrics.jsonl"), fresh=self.step == 0) if self.rank == 0 else None

    # -- set-up -------------------------------------------------------------------
    def _apply_plan(self) -> list[Any]:
        """Validate and apply ``replace`` + ``low_precision`` (see :mod:`megaloom.models.plan`)."""
        lp = self.cfg["low_precision"]
        if not self.cfg["replace"]["rules"] and (lp["linear"] or lp["format"]) == "none":
            return []
        from megaloom.models.plan import apply_config_plan  # imports the graphs and mxfp8 layers
        return apply_config_plan(self.base_model, self.cfg, self.log, self.mesh.ep)

    def _peak_flops(self) -> float | None:
        par, hw = self.cfg["parallel"], self.cfg["run"]["hardware"]
        try:
            return peak_flops(hw, par["fsdp_param_dtype"] or self.cfg["model"]["dtype"])
        except ConfigError as e:
            raise ConfigError(f"run.hardware: {e}") from None

    def _micro_batch(self, step: int, m: int) -> torch.Tensor:
        """Micro-batch ``m`` of this data rank at 0-based ``step``: global micro-batch ``data_rank * accum + m``
        (so one rank accumulating D micro-batches reads what D data ranks read)."""
        dp, dp_rank = self.dims.dp, self.mesh.coord("dp")
        return self.data.batch(step, dp_rank * self.accum + m, dp * self.accum)

    def _probe(self) -> torch.Tensor:
        """Loss of this rank's first micro-batch (for measuring a forward at set-up)."""
        return lm_loss(self.base_model, *split(self._micro_batch(0, 0), self.mesh.coord("cp"), self.dims.cp))

    # -- one step -----------------------------------------------------------------
    def train_step(self) -> StepRecord:
        """Run optimizer step ``self.step + 1`` (1-based in records, 0-based for data and lr)."""
        t0 = time.perf_counter()
        reset_peak_memory()
        self.clock.take()
        tracing = self.tracer is not None and self.step + 1 in self.cfg["trace"]["steps"]
        total = torch.zeros((), dtype=torch.float64)
        with self.tracer.active() if tracing else nullcontext():
            if tracing:
                self._graph_traces(start=True)
            for m in range(self.accum):
                inputs, labels, positions = self.parallel.inputs(self._micro_batch(self.step, m))
                self.parallel.set_sync(m == self.accum - 1)
                with self._phase(tracing, "forward"):
                    loss = lm_loss(self.model, inputs, labels, positions)
                with self._phase(tracing, "backward"):
                    (loss / self.accum if self.accum > 1 else loss).backward()
                total += loss.detach()
            with self._phase(tracing, "grad_sync"):
                self.parallel.sync_grads()
            with self._phase(tracing, "optimizer"):
                norm = self._clip()
                lr = self.cfg["optimizer"]["lr"] * lr_factor(self.step, self.cfg["schedule"])
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if tracing:  # the graphs' own task events, on cube / vector / comm tracks
                for name, direction, trace in self._graph_traces():
                    self.tracer.add_events(trace.events, name, direction)
        self.step += 1
        if tracing:
            self._write_trace()
        mean_loss = self.parallel.mean(total / self.accum)
        dt = time.perf_counter() - t0
        tokens = labels.shape[0] * self.cfg["data"]["seq_len"] * self.accum * self.dims.dp
        rate = tokens / max(dt, 1e-9)
        mfu = rate * self.flops_per_token / (self.peak_flops * self.world) if self.peak_flops else None
        return StepRecord(self.step, mean_loss, lr, norm, tokens, rate, peak_memory_mib(), self.clock.take(), mfu, dt)

    def _graph_traces(self, start: bool = False) -> list[tuple[str, str, Any]]:
        """(module, direction, trace) of every graph run of the modules on a graph runner (MegaMoE blocks,
        MegaGate routers, ...) since the last start, every micro-batch's; ``start``: record from now on."""
        out = []
        for name, m in self.base_model.named_modules():
            runner = getattr(m, "runner", None)
            if isinstance(runner, GraphRunner):
                out += [(name, d, t) for d, t in runner.record(start)]
        return out

    def _phase(self, tracing: bool, name: str):
        return self.tracer.phase(name) if tracing else nullcontext()

    def _clip(self) -> float:
        clip = self.cfg["optimizer"]["grad_clip"]
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self.parallel.grad_norm(params)
        if clip > 0 and norm > clip:
            for p in params:
                p.grad.mul_(clip / (norm + 1e-6))
        return norm

    # -- the loop -----------------------------------------------------------------
    def fit(self) -> list[StepRecord]:
        """Train until ``schedule.steps`` (or ``checkpoint.stop_after``); returns this call's records."""
        sched, ck, run = self.cfg["schedule"], self.cfg["checkpoint"], self.cfg["run"]
        stop = min(sched["steps"], ck["stop_after"] or sched["steps"])
        bar = Progress(sched["steps"], enabled=run["progress"] and self.rank == 0)
        records = []
        try:
            while self.step < stop:
                rec = self.train_step()
                records.append(rec)
                if rec.step % run["log_interval"] == 0 or rec.step == stop:
                    bar.update(rec.as_dict())
                    if self.metrics is not None:
                        self.metrics.write(rec.as_dict())
                if (ck["interval"] and rec.step % ck["interval"] == 0) or rec.step == stop:
                    self.save()
        finally:
            bar.close()
            if self.tracer is not None:
                self.tracer.close()
        return records

    # -- checkpoints and traces ---------------------------------------------------
    def save(self) -> str:
        """Checkpoint this step (DCP, see :mod:`megaloom.train.checkpoint`); a collective. Returns the step directory."""
        path = ckpt.save(self.ckpt_dir, self.step, self.parallel, self.optimizer, self.cfg["checkpoint"]["keep"])
        self.log(f"saved checkpoint of step {self.step} to {path}")
        return path

    def _load(self, path: str) -> None:
        from megaloom.train import interop

        if interop.is_torch_checkpoint(path):
            self.step = interop.load_torch(path, self.comm, self.parallel.checkpoint_params(), self.optimizer)
        else:
            self.step = ckpt.load(path, self.parallel, self.optimizer)
        self.log(f"resumed from {path} at step {self.step}")

    def _write_trace(self) -> None:
        os.makedirs(self.trace_dir, exist_ok=True)
        trace = self.tracer.trace(self.step)
        base = os.path.join(self.trace_dir, f"step{self.step}.rank{self.rank}")
        trace.save(base + ".trace")
        if self.cfg["trace"]["perfetto"]:
            write_chrome(trace, base + ".json")
        self.log(f"trace of step {self.step}: {base}.trace")


def _default_comm(par: dict) -> Any:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from megaloom.comm.torch_comm import TorchCommunicator
        return TorchCommunicator(backend=par["backend"], timeout=par["timeout_s"])
    from megaloom.comm.communicator import LocalCommunicator
    return LocalCommunicator()


def _setup_parallel(model: nn.Module, par: dict, comm: Any, mesh: Any, clock: CommClock, log, probe):
    from megaloom.train.parallel import setup  # imports megaloom.comm only when needed
    return setup(model, par, comm, mesh, clock, log, probe)


def train(cfg: Config, comm: Any = None, log=None) -> list[StepRecord]:
    """Build a :class:`Trainer` from ``cfg`` and run it."""
    return Trainer(cfg, comm=comm, log=log).fit()


def _writable_dir(key: str, path: str | None) -> None:
    """Create ``path`` (the directory of config key ``key``); ConfigError when it cannot be written."""
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}: cannot create directory {path!r}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: directory {path!r} is not writable")
