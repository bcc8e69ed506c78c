"""The trainer: a YAML config in, a trained model, metrics, traces and checkpoints out.

    config ──> build model (seeded) ──> device mesh ──> replacement plan (validated, then
    applied, outputs checked; MegaMoE gets the expert-parallel group) ──> parallel set-up
    (TP, CP, recomputation, FSDP2) ──> optimizer
    ──> for each step: the step's rows of the data stream -> this data rank's micro-batches -> for each:
        forward -> loss (summed over target tokens / the step's target tokens of all ranks, + MoE aux loss)
        -> backward;  then grad sync -> grad norm (NaN / inf: stop, or skip the update) -> clip -> lr(step)
        -> optimizer step (-> MoE bias update) -> metrics (loss, tokens/s, peak memory, MFU, comm time,
        expert load) to metrics.jsonl and TensorBoard / progress / eval / trace / checkpoint

Every random choice is derived from ``run.seed`` and the step number, and the data stream's
position rides in checkpoints, so a run that stops after step k and resumes from its checkpoint
reproduces the losses of an uninterrupted run exactly. An out_dir holding a previous run is
refused unless the run resumes (or overwrites it); a checkpoint is never written with a
non-finite tensor.
"""
from __future__ import annotations

import glob
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.graphs.common.runner import GraphRunner
from megaloom.models.hf_moe import build_model
from megaloom.runtime.errors import ConfigError, ExecutionError
from megaloom.runtime.perfetto import write_chrome
from megaloom.train import checkpoint as ckpt
from megaloom.train.balance import Balance
from megaloom.train.config import Config
from megaloom.train.data import make_stream
from megaloom.train.flops import flops_per_token, peak_flops
from megaloom.train.optim import make_optimizer
from megaloom.train.parallel import mesh as meshes
from megaloom.train.parallel.setup import setup
from megaloom.train.parallel.clock import CommClock, TimedCommunicator
from megaloom.train.parallel.context import split
from megaloom.train.parallel.recompute import decoder_layers
from megaloom.train.progress import MetricsLog, Progress, peak_memory_mib, reset_peak_memory
from megaloom.train.step_trace import StepTracer


@dataclass(slots=True)
class StepRecord:
    """What one optimizer step produced: loss averaged over every rank's target tokens, tokens of all data
    ranks, this rank's peak memory (MiB), comm time (s with a collective in flight), MFU (None: no hardware
    profile); ``skipped`` (a non-finite loss or gradient), the MoE aux loss, each router's per-expert share
    of the step's tokens and the eval loss and perplexity where there are any (None fields are not logged)."""

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
    skipped: bool = False
    aux_loss: float | None = None
    expert_load: list[list[float]] | None = None
    eval_loss: float | None = None
    eval_ppl: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) is not None}


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


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None, cp_rank: int = 0,
                   cp_size: int = 1) -> torch.Tensor:
    """Mean next-token cross entropy of ``tokens [B, S+1]`` (inputs ``[:, :-1]``, labels ``[:, 1:]``; packed
    documents: their ``positions``), over context-parallel rank ``cp_rank``'s part of the sequence."""
    total, count = lm_loss(model, *split(tokens, positions, cp_rank, cp_size))
    return total / count


def lm_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None,
            autocast: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross entropy, number of targets) of ``model``'s logits for ``inputs`` against ``labels``
    (-100: no target), run under ``torch.autocast`` to the dtype named ``autocast`` if given."""
    with torch.autocast(inputs.device.type, getattr(torch, autocast)) if autocast else nullcontext():
        logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


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
        resume_from = ckpt.find(cfg["checkpoint"]["resume"], self.ckpt_dir)
        _claim_out_dir(run, self.ckpt_dir, cfg["checkpoint"]["resume"] is not False, self.rank == 0)
        if self.world > 1:
            self.comm.barrier()  # every rank has looked before rank 0 writes into out_dir
        self.seed = run["seed"]
        par = cfg["parallel"]
        self.dims = meshes.MeshDims.of(par, self.world)
        self.accum = cfg["optimizer"]["grad_accum_steps"]
        self.clock = CommClock()
        self.base_model = build_model(cfg["model"], self.seed)
        self.vocab = int(self.base_model.config.vocab_size)
        self.flops_per_token = flops_per_token(self.base_model, cfg["data"]["seq_len"])
        self.peak_flops, source = peak_flops(run["hardware"], cfg["parallel"]["fsdp_param_dtype"]
                                             or cfg["model"]["autocast"] or cfg["model"]["dtype"])
        self.log(f"MFU peak: {self.peak_flops:.3g} FLOP/s per rank from {source}" if self.peak_flops else "MFU: none")
        self.data = make_stream(cfg, self.vocab, self.seed)
        self.eval_data = make_stream(cfg, self.vocab, self.seed, "eval") if cfg["eval"]["interval"] else None
        self.eval_start = self.eval_data.state() if self.eval_data else None  # every evaluation reads from here
        self.mesh = meshes.build(self.dims, self.comm, par["backend"], lambda c: TimedCommunicator(c, self.clock))
        self.balance = Balance(cfg["moe"], self.base_model.config)
        lp = cfg["low_precision"]
        if cfg["replace"]["rules"] or (lp["linear"] or lp["format"]) != "none":
            from megaloom.models.plan import apply_config_plan  # imports the graphs and mxfp8 layers
            apply_config_plan(self.base_model, cfg, self.log, self.mesh.ep)  # validates and applies both plans
        self.balance.attach(self.base_model)
        self.parallel = setup(self.base_model, par, self.mesh.world or TimedCommunicator(self.comm, self.clock),
                              self.mesh, self.clock, self.log, self._probe)
        self.model = self.parallel.model  # the base model (FSDP2 and TP convert its modules in place)
        if cfg["model"]["compile"]:
            backend = "inductor" if cfg["model"]["compile"] is True else cfg["model"]["compile"]
            for _, layer in decoder_layers(self.model):
                layer.compile(backend=backend)
        self.optimizer = make_optimizer(self.model, cfg["optimizer"])
        self.step = 0
        if resume_from is not None:
            self._load(resume_from)
        self.tracer = StepTracer(self.base_model, self.rank, self.world) if cfg["trace"]["steps"] else None
        self.metrics = MetricsLog(run["out_dir"], self.step, run["tensorboard"]) if self.rank == 0 else None

    # -- set-up -------------------------------------------------------------------
    def _micro_batches(self, stream: Any) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, labels, position ids) of each micro-batch of the next step of ``stream``: micro-batch
        ``m`` is global micro-batch ``data_rank * accum + m`` (so one rank accumulating D micro-batches reads what D
        data ranks read)."""
        b = self.cfg["data"]["batch_size"]
        tokens, positions = stream.read(self.accum * b * self.dims.dp)
        first = self.mesh.coord("dp") * self.accum
        return [self.parallel.inputs(tokens[i * b:(i + 1) * b], positions[i * b:(i + 1) * b])
                for i in range(first, first + self.accum)]

    def _probe(self) -> torch.Tensor:
        """Loss of a seeded batch of this rank's shape (for measuring a forward at set-up)."""
        d = self.cfg["data"]
        tokens = torch.randint(0, self.vocab, (d["batch_size"], d["seq_len"] + 1),
                               generator=torch.Generator().manual_seed(self.seed))
        return causal_lm_loss(self.base_model, tokens, None, self.mesh.coord("cp"), self.dims.cp)

    # -- one step -----------------------------------------------------------------
    def train_step(self) -> StepRecord:
        """Run optimizer step ``self.step + 1`` (1-based in records, 0-based for data and lr)."""
        t0 = time.perf_counter()
        reset_peak_memory()
        self.clock.take()
        tracing = self.tracer is not None and self.step + 1 in self.cfg["trace"]["steps"]
        batches = self._micro_batches(self.data)
        targets = self.parallel.mean(sum(labels.ne(-100).sum() for _, labels, _ in batches)) or 1.0
        total, aux_total = torch.zeros((), dtype=torch.float64), 0.0
        autocast = self.cfg["model"]["autocast"]
        with self.tracer.active() if tracing else nullcontext():
            if tracing:
                self._graph_traces(start=True)
            for m, (inputs, labels, positions) in enumerate(batches):
                self.parallel.set_sync(m == self.accum - 1)
                with self._phase(tracing, "forward"):
                    self.balance.forward()
                    ce, _ = lm_loss(self.model, inputs, labels, positions, autocast)
                    loss, aux = ce / targets, self.balance.aux_loss()
                    if aux is not None:
                        loss, aux_total = loss + aux * (self.balance.coef / self.accum), aux_total + float(aux.detach())
                with self._phase(tracing, "backward"):
                    loss.backward()
                total += ce.detach() / targets
            with self._phase(tracing, "grad_sync"):
                self.parallel.sync_grads()
            with self._phase(tracing, "optimizer"):
                mean_loss = self.parallel.mean(total)
                lr, skipped, norm = self._update(mean_loss)
            if tracing:  # the graphs' own task events, on cube / vector / comm tracks
                for name, direction, trace in self._graph_traces():
                    self.tracer.add_events(trace.events, name, direction)
        self.step += 1
        if tracing:
            self._write_trace()
        load = self.balance.step_loads(lambda t: self.parallel.mean(t) * self.world)
        dt = time.perf_counter() - t0
        tokens = labels.shape[0] * self.cfg["data"]["seq_len"] * self.accum * self.dims.dp
        rate = tokens / max(dt, 1e-9)
        mfu = rate * self.flops_per_token / (self.peak_flops * self.world) if self.peak_flops else None
        aux = self.parallel.mean(torch.tensor(aux_total / self.accum)) if self.balance.mode == "aux_loss" else None
        return StepRecord(self.step, mean_loss, lr, norm, tokens, rate, peak_memory_mib(), self.clock.take(), mfu, dt,
                          skipped, aux, None if load is None else [[round(x, 4) for x in r] for r in load.tolist()])

    def _update(self, mean_loss: float) -> tuple[float, bool, float]:
        """Clip, set the lr and step the optimizer unless the loss or the gradient norm is not finite (then stop
        or skip, as ``run.on_nonfinite`` says); returns (lr, skipped, gradient norm)."""
        clip = self.cfg["optimizer"]["grad_clip"]
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self.parallel.grad_norm(params)
        lr = self.cfg["optimizer"]["lr"] * lr_factor(self.step, self.cfg["schedule"])
        finite = math.isfinite(mean_loss) and math.isfinite(norm)
        if not finite and self.cfg["run"]["on_nonfinite"] == "stop":
            raise ExecutionError(f"step {self.step + 1}: loss {mean_loss}, gradient norm {norm}: not finite; stopped "
                                 f"before the update (run.on_nonfinite=skip skips such steps instead)")
        if finite:
            if clip > 0 and norm > clip:
                for p in params:
                    p.grad.mul_(clip / (norm + 1e-6))
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        else:
            self.log(f"step {self.step + 1}: loss {mean_loss}, gradient norm {norm}: not finite; update skipped")
        self.optimizer.zero_grad(set_to_none=True)
        return lr, not finite, norm

    def _graph_traces(self, start: bool = False) -> list[tuple[str, str, Any]]:
        """(module, direction, trace) of every graph run of the modules on a graph runner (MegaMoE blocks,
        MegaGate routers, ...) since the last start, every micro-batch's; ``start``: record from now on."""
        return [(name, d, t) for name, m in self.base_model.named_modules()
                if isinstance(getattr(m, "runner", None), GraphRunner) for d, t in m.runner.record(start)]

    def _phase(self, tracing: bool, name: str):
        return self.tracer.phase(name) if tracing else nullcontext()

    def evaluate(self) -> tuple[float, float]:
        """(loss, perplexity) over every target token of ``eval.batches`` batches of the eval split (a collective)."""
        self.eval_data.load(self.eval_start)
        sums = torch.zeros(2, dtype=torch.float64)
        self.model.eval()
        with torch.no_grad():
            for _ in range(self.cfg["eval"]["batches"]):
                for inputs, labels, positions in self._micro_batches(self.eval_data):
                    sums += torch.stack(lm_loss(self.model, inputs, labels, positions, self.cfg["model"]["autocast"]))
        self.model.train()
        total, count = self.parallel.mean(sums).tolist()
        loss = total / max(count, 1e-30)
        return loss, math.exp(min(loss, 700.0))

    # -- the loop -----------------------------------------------------------------
    def fit(self) -> list[StepRecord]:
        """Train until ``schedule.steps`` (or ``checkpoint.stop_after``); returns this call's records."""
        sched, ck, run, ev = self.cfg["schedule"], self.cfg["checkpoint"], self.cfg["run"], self.cfg["eval"]
        stop = min(sched["steps"], ck["stop_after"] or sched["steps"])
        bar = Progress(sched["steps"], enabled=run["progress"] and self.rank == 0)
        records = []
        try:
            while self.step < stop:
                rec = self.train_step()
                records.append(rec)
                if ev["interval"] and rec.step % ev["interval"] == 0:
                    rec.eval_loss, rec.eval_ppl = self.evaluate()
                if rec.step % run["log_interval"] == 0 or rec.step == stop or rec.eval_loss is not None:
                    bar.update(rec.as_dict())
                    if self.metrics is not None:
                        self.metrics.write(rec.as_dict())
                if (ck["interval"] and rec.step % ck["interval"] == 0) or rec.step == stop:
                    self.save()
        finally:
            for closing in (bar, self.tracer, self.metrics):
                if closing is not None:
                    closing.close()
        return records

    # -- checkpoints and traces ---------------------------------------------------
    def save(self) -> str:
        """Checkpoint this step (DCP, see :mod:`megaloom.train.checkpoint`); a collective. Returns the step directory.
        A model or optimizer state with a NaN or inf in it is never saved: ExecutionError, earlier checkpoints kept."""
        tensors = [t for t, _ in self.parallel.checkpoint_params().values()]
        tensors += [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        bad = sum(not bool(torch.isfinite(getattr(t, "_local_tensor", t)).all()) for t in tensors)
        if self.parallel.mean(torch.tensor(float(bad))) > 0:
            raise ExecutionError(f"step {self.step}: the model or optimizer state holds NaN or inf values; not saved "
                                 f"(the checkpoints in {self.ckpt_dir} are kept)")
        path = ckpt.save(self.ckpt_dir, self.step, self.parallel, self.optimizer, self.cfg["checkpoint"]["keep"],
                         {"data": self.data.state()})
        self.log(f"saved checkpoint of step {self.step} to {path}")
        return path

    def _load(self, path: str) -> None:
        from megaloom.train import interop

        if interop.is_torch_checkpoint(path):
            self.step, state = interop.load_torch(path, self.comm, self.parallel.checkpoint_params(), self.optimizer), {}
        else:
            self.step, state = ckpt.load(path, self.parallel, self.optimizer)
        if "data" in state:
            self.data.load(state["data"])
        else:  # a checkpoint without the stream's position: the steps before it read from the start
            for _ in range(self.step):
                self._micro_batches(self.data)
        self.log(f"resumed from {path} at step {self.step}")

    def _write_trace(self) -> None:
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


def _claim_out_dir(run: dict, ckpt_dir: str, resuming: bool, owner: bool) -> None:
    """Refuse an out_dir holding a previous run's metrics, events or checkpoints unless resuming; with
    ``run.overwrite``, ``owner`` (rank 0) deletes them instead."""
    out = run["out_dir"]
    found = [f for folder, pattern in ((out, "metrics.jsonl"), (out, "events.out.tfevents.*"),
                                       (ckpt_dir, ckpt.LATEST), (ckpt_dir, "step_*"))
             for f in glob.glob(os.path.join(glob.escape(folder), pattern))]
    if not found or resuming:
        return
    if not run["overwrite"]:
        raise ConfigError(f"run.out_dir: {out} holds a previous run ({', '.join(sorted(found)[:3])}, ...): resume it "
                          "(--checkpoint.resume=true), overwrite it (--run.overwrite=true) or choose another out_dir")
    for f in found if owner else ():
        shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)


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
