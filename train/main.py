"""Train an EAGLE-3 drafter on a redraft dataset: build data, build the drafter, resume, then step and checkpoint.

    accelerate launch [--config_file configs/accelerate/X.yaml] train/main.py --config configs/demo/train.yaml \
        [--data D --out O --max-steps N --resume auto --init-from DIR --report-to none] [--any_field value]
    python train/main.py ...        # one process, same code
    python -m train.main --help     # every option

The code is identical for one CPU process, CPU DeepSpeed over gloo and 8 GPUs: DeepSpeed (ZeRO-2)
comes only from the accelerate config file. Batches are built by train/data.py and sharded by
rank there (never by accelerate.prepare), so resume replays the exact data order, also on another
world size (the rule: train/data.py and train/checkpoint.py).

The parts, as ``main`` reads: ``build_data`` (train/data.py) or ``build_stream`` (train/stream.py), ``build_drafter`` (train/drafter_setup.py),
``build_optimizer``, ``Trainer.resume``, then ``Trainer.fit``: ``train_step`` per micro-batch,
``evaluate`` and ``save`` on their schedule.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from redraft.core import cli as ending
from train.checkpoint import ResumePoint, output_lock, read_trainer_state
from train.config import ConfigError, TrainConfig, parse_cli
from train.data import SamplerState, TrainData

log = logging.getLogger("redraft.train")


# ============================================================================ helpers


def make_accelerator(cfg: TrainConfig) -> Any:
    """Accelerator whose process group really spans WORLD_SIZE ranks (gloo when there is no CUDA)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    use_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
    launched = int(os.environ.get("LOCAL_RANK", "-1")) != -1  # under torchrun / accelerate launch
    # A plain process must get no backend (accelerate would query a process group that never exists).
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.grad_accum,
        # DeepSpeed takes precision from its json (accelerate refuses both); otherwise bf16 = autocast.
        mixed_precision=None if use_ds else ("bf16" if cfg.dtype == "bf16" else "no"),
        kwargs_handlers=handlers,
        log_with="wandb" if cfg.report_to == "wandb" else None,
        project_dir=cfg.out,
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != world:
        raise RuntimeError(
            f"accelerator sees {accelerator.num_processes} process(es) but WORLD_SIZE={world}: every rank would "
            "train on the whole dataset alone. On CPU launch with a DeepSpeed config "
            "(configs/accelerate/cpu-2proc-zero2.yaml) or ACCELERATE_USE_CPU=true, not --cpu/--multi_gpu."
        )
    return accelerator


def configure_deepspeed(accelerator: Any, cfg: TrainConfig, universal: bool = False) -> None:
    """Fill the DeepSpeed json's "auto" values from the TrainConfig; refuse contradictions and ZeRO-3.

    universal: load the checkpoint in DeepSpeed's universal form (an elastic resume, train/checkpoint.py)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    where = getattr(plugin, "hf_ds_config", None)
    where = getattr(where, "config_file", None) or "the DeepSpeed config"
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    if stage == 3:
        raise ValueError(f"{where}: zero_optimization.stage 3 is not supported (the drafter is small; use stage 2)")
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = max(cfg.micro_batch_size, 1)  # batches are token-bucketed
    checks = {
        "gradient_clipping": (ds.get("gradient_clipping", "auto"), cfg.max_grad_norm, "max_grad_norm"),
        "gradient_accumulation_steps": (ds.get("gradient_accumulation_steps", "auto"), cfg.grad_accum, "grad_accum"),
    }
    for key, (have, want, name) in checks.items():
        if have == "auto":
            ds[key] = want
        elif float(have) != float(want):
            raise ValueError(f"{where}: {key}={have} contradicts the train config's {name}={want}; set it to \"auto\"")
    if (ds.get("fp16") or {}).get("enabled") is True:
        raise ValueError(f"{where}: fp16 is not supported; use bf16 (train dtype=bf16) or fp32")
    bf16 = (ds.get("bf16") or {}).get("enabled", False)
    want_bf16 = cfg.dtype == "bf16"
    if bf16 == "auto":
        ds.setdefault("bf16", {})["enabled"] = want_bf16
    elif bool(bf16) != want_bf16:
        raise ValueError(f"{where}: bf16.enabled={bf16} contradicts the train config's dtype={cfg.dtype}")
    if universal:
        ds.setdefault("checkpoint", {})["load_universal"] = True


def cosine_with_warmup(total_steps: int, warmup_ratio: float, min_ratio: float):
    """LambdaLR factor: linear warmup over ceil(ratio*total) steps, then cosine down to min_ratio."""
    warmup = math.ceil(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(1, total_steps - warmup), 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def setup_logging(rank: int, main_process: bool) -> None:
    """INFO on rank 0, warnings elsewhere, each line tagged with its rank; a set-up someone else made (pytest, a
    caller) is left alone (redraft.core.cli.configure_logging)."""
    ending.configure_logging(logging.INFO if main_process else logging.WARNING,
                             f"%(asctime)s [rank{rank}] %(name)s %(levelname)s: %(message)s")


# ============================================================================ parts


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, total_steps: int) -> tuple[Any, Any]:
    """AdamW over the trainable parameters and the cosine schedule, stepped by hand once per optimizer step
    (accelerate's prepared scheduler would step world-size times)."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))
    return optimizer, scheduler


def plan_resume(cfg: TrainConfig) -> tuple[TrainConfig, ResumePoint | None]:
    """The checkpoint to resume from, fitted to this launch's world size (before the accelerator exists: an
    elastic resume sets grad_accum); the config as this run uses it."""
    from train.checkpoint import find_resume_checkpoint, resume_point

    folder = find_resume_checkpoint(Path(cfg.out), cfg.resume)
    if folder is None:
        if cfg.resume == "auto":
            log.info("resume=auto: no checkpoint under %s, starting fresh", cfg.out)
        return cfg, None
    saved_sp = int(read_trainer_state(folder).get("sequence_parallel", 1))
    if saved_sp != cfg.sequence_parallel:
        raise ConfigError(f"{folder}: saved with sequence_parallel={saved_sp}, this run asks {cfg.sequence_parallel}; "
                          f"resume with sequence_parallel {saved_sp} (the number of processes may differ)")
    point = resume_point(folder, data_world(cfg, int(os.environ.get("WORLD_SIZE", "1"))), cfg.grad_accum)
    return replace(cfg, grad_accum=point.grad_accum), point


def data_world(cfg: TrainConfig, world: int) -> int:
    """Data-parallel ranks: the processes over ``sequence_parallel`` (each group of that many trains one
    micro-batch together)."""
    if world % cfg.sequence_parallel:
        raise ConfigError(f"sequence_parallel={cfg.sequence_parallel} does not divide the {world} process(es) of this "
                          "launch")
    return world // cfg.sequence_parallel


def run_record(cfg: TrainConfig, data: TrainData, warm_info: dict[str, Any] | None) -> dict[str, Any]:
    """redraft.json of every checkpoint: the dataset's fingerprint, the held-out ids, the config."""
    manifest = data.reader.manifest
    record = {
        "format": "redraft-checkpoint",
        "dataset": {
            "path": str(Path(cfg.data).resolve()),
            "tokenizer_hash": manifest.get("tokenizer_hash"),
            "chat_template_hash": manifest.get("chat_template_hash"),
            "target_config_hash": manifest["target"].get("config_hash"),
            "target_name": manifest["target"].get("name"),
            "num_samples": data.num_samples,
            "teacher": data.teacher,
        },
        "val_ids": data.val_ids,
        "train_config": cfg.to_dict(),
    }
    if warm_info is not None:
        record["warm_start"] = warm_info
    return record


class Trainer:
    """The prepared model, optimizer and data of one run, and where it stands; ``fit`` is the loop."""

    def __init__(self, cfg: TrainConfig, accelerator: Any, data: TrainData, model: Any, optimizer: Any,
                 scheduler: Any, record: dict[str, Any]) -> None:
        from train.tracking import StepStats

        self.cfg, self.accelerator, self.data = cfg, accelerator, data
        self.model, self.optimizer, self.scheduler, self.record = model, optimizer, scheduler, record
        self.unwrapped = accelerator.unwrap_model(model)
        self.sp_size = cfg.sequence_parallel
        self.world = data_world(cfg, accelerator.num_processes)  # data-parallel ranks: one micro-batch each
        self.in_dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        self.step, self.tokens_seen, self.last_saved = 0, 0, -1
        self.state = SamplerState()
        self.stats = StepStats(cfg.ttt_steps, accelerator.device)
        self.grad_norm: Any = float("nan")  # a device tensor between log steps: float() only when logged
        self.lr = float("nan")  # of the last optimizer step
        self.tracker: Any = None
        self.ids_log: Any = None
        self.finished = False  # the data ran out (a stream, read once) before the schedule's end

    # ------------------------------------------------------------------------------------------ resume

    def resume(self, point: ResumePoint | None) -> None:
        """Optimizer, schedule and data position from the checkpoint (its drafter weights are loaded already)."""
        if point is None:
            return
        from train.checkpoint import TRAINING_STATE, universal_training_state

        ts_dir = point.folder / TRAINING_STATE
        pickled = sorted(ts_dir.glob("custom_checkpoint_*.pkl"))
        if pickled:
            raise ValueError(f"{pickled[0]}: a pickled LR scheduler from an older redraft (not loaded: pickles can "
                             "run code); delete the file to resume, the schedule is recomputed from the step")
        uses_deepspeed = getattr(self.accelerator.state, "deepspeed_plugin", None) is not None
        if point.deepspeed != uses_deepspeed:
            saved, now = ("DeepSpeed", "without it") if point.deepspeed else ("without DeepSpeed", "with it")
            raise ValueError(f"{ts_dir}: saved {saved}, this run is launched {now}; resume with the launch "
                             "config the run was saved with (its number of processes may differ)")
        if point.elastic and uses_deepspeed:
            ts_dir = universal_training_state(point, self.accelerator)
        self.accelerator.load_state(str(ts_dir))
        # accelerate's micro-batch counter decides which micro-batch syncs (step % grad_accum); it comes back
        # from the saved run, in that run's grad_accum: restate it in this run's (elastic resume changes it)
        self.accelerator.step = point.step * self.cfg.grad_accum
        self.step, self.tokens_seen, self.last_saved = point.step, point.tokens_seen, point.step
        self.state = SamplerState(point.epoch, point.position)
        self.data.load_state_dict(point.data)
        if point.scheduler is not None:
            self.scheduler.load_state_dict(point.scheduler)
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr  # the universal load does not carry the groups' lr; the schedule does
        else:  # older checkpoints: LambdaLR is a pure function of the step count
            for _ in range(self.step):
                self.scheduler.step()
        log.info("resumed from %s: step %d, epoch %d, global position %d%s", point.folder, self.step,
                 self.state.epoch, self.state.position,
                 f" (saved on {point.saved_world_size} process(es), now {self.world} x grad_accum "
                 f"{point.grad_accum})" if point.elastic else "")

    # ------------------------------------------------------------------------------------------ step

    def train_step(self, batch: Any) -> bool:
        """Forward, backward and (at a gradient-sync micro-batch) the optimizer step; True when it stepped."""
        acc, cfg = self.accelerator, self.cfg
        self.state.position += self.world  # every data-parallel rank trains one micro-batch of the global list
        with acc.accumulate(self.model):
            out = self.model(self.unwrapped.shard(batch).to(acc.device, self.in_dtype))
            # the gradient is a mean over every process; a sequence-parallel group's is the sum of its ranks' shares
            acc.backward(out.loss * self.sp_size if self.sp_size > 1 else out.loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.grad_norm = norm.detach() if isinstance(norm, torch.Tensor) else norm
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.stats.add(out, batch.num_tokens, int(batch.loss_mask.sum()), share=1 / self.sp_size)
        self.tokens_seen += batch.num_tokens
        if self.ids_log is not None:
            self.ids_log.write(json.dumps({"epoch": self.state.epoch, "position": self.state.position,
                                           "ids": batch.sample_ids}) + "\n")
        if not acc.sync_gradients:
            return False
        self.lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        return True

    def evaluate(self) -> dict[str, Any] | None:
        """Loss, accuracy per TTT step and τ on the held-out samples (a collective)."""
        from train.tracking import StepStats

        batches = self.data.val_batches()
        if not batches:
            return None
        stats = StepStats(self.cfg.ttt_steps, self.accelerator.device)
        self.model.eval()
        with torch.no_grad():
            for batch in self.data.loader(batches):
                out = self.model(self.unwrapped.shard(batch).to(self.accelerator.device, self.in_dtype))
                stats.add(out, batch.num_tokens, int(batch.loss_mask.sum()), share=1 / self.sp_size)
        self.model.train()
        return stats.summary(self.accelerator)

    def save(self) -> Path:
        from train.checkpoint import ORDER_RULE, save_checkpoint

        trainer_state = {"step": self.step, "epoch": self.state.epoch, "position": self.state.position,
                         "order_rule": ORDER_RULE, "world_size": self.world, "sequence_parallel": self.sp_size,
                         "micro_batches_per_step": self.world * self.cfg.grad_accum,
                         "tokens_seen": self.tokens_seen, "total_steps": self.data.total_steps,
                         "scheduler": self.scheduler.state_dict(), "data": self.data.state_dict()}
        folder = save_checkpoint(self.accelerator, self.cfg.out, self.step, drafter=self.unwrapped.drafter,
                                 record={**self.record, "step": self.step}, trainer_state=trainer_state,
                                 keep_last=self.cfg.keep_last)
        self.last_saved = self.step
        self.data.saved(self.state, finished=self.finished)  # a stream consumes the shards behind the checkpoint
        return folder

    def _save_if_behind(self) -> None:
        """Before waiting for data: save unsaved progress, so that a stream can consume what lies behind it."""
        if self.last_saved != self.step:
            log.info("waiting for data at step %d: saving first, so the shards behind it can go", self.step)
            self.save()
        else:  # saved already: groups passed since without a step (no trainable sample) can still go
            self.data.saved(self.state, finished=self.finished)

    # ------------------------------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        """Train to the end of the schedule (or ``stop_at_step``), logging, evaluating and saving on schedule."""
        from train.tracking import Tracker

        cfg, out, total = self.cfg, Path(self.cfg.out), self.data.total_steps
        self.tracker = Tracker(self.accelerator, out, config=cfg.to_dict(), total_steps=total, start_step=self.step,
                               report_to=cfg.report_to, project=cfg.wandb_project, run_name=cfg.run_name or out.name)
        if cfg.log_sample_ids:
            (out / "sample_ids").mkdir(parents=True, exist_ok=True)
            # line-buffered: a killed run leaves whole lines, every one up to its last micro-batch
            self.ids_log = open(out / "sample_ids" / f"rank-{self.accelerator.process_index}.jsonl", "a", buffering=1)
        end_step = min(total, cfg.stop_at_step) if cfg.stop_at_step > 0 else total
        self.last_val, self.t_window = None, time.perf_counter()
        self.model.train()
        while self.step < end_step:
            if self._train_epoch(end_step):
                break
            if self.data.exhausted():
                self.finished = True
                log.warning("the stream is trained to its end at step %d of the schedule's %d (a larger dataset "
                            "or stream_keep for more epochs would have filled it)", self.step, total)
                break
            self.state = SamplerState(self.state.epoch + 1, 0)
        if self.last_saved != self.step:
            self.save()
        elif self.finished:
            self.data.saved(self.state, finished=True)
        self.data.close(self.step, self.finished)
        return self._finish(self.last_val)

    def _train_epoch(self, end_step: int) -> bool:
        """The rest of the epoch, chunk by chunk as the data has it; True when ``end_step`` is reached."""
        cfg, total = self.cfg, self.data.total_steps
        for chunk in self.data.chunks(self.state, self._save_if_behind):
            for batch in self.data.loader(chunk):
                if not self.train_step(batch):
                    continue
                if self.step % cfg.log_every == 0 or self.step == total:
                    self._log_train(time.perf_counter() - self.t_window)
                    self.t_window = time.perf_counter()
                else:
                    self.tracker.progress(self.step)
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == total:
                    self.last_val = self.evaluate()
                    if self.last_val is not None:
                        self.tracker.log("val", self.step, self.last_val)
                if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == end_step:
                    self.save()
                if self.step >= end_step:
                    return True
        return False

    def _log_train(self, elapsed: float) -> None:
        m = self.stats.summary(self.accelerator)
        grad_norm = float("nan") if self.grad_norm is None else float(self.grad_norm)
        m.update(lr=self.lr, grad_norm=grad_norm, epoch=self.state.epoch, tokens_per_s=m["tokens"] / max(elapsed, 1e-9))
        self.tracker.log("train", self.step, m)
        self.tracker.progress(self.step, m)
        self.stats.reset()

    def _finish(self, last_val: dict[str, Any] | None) -> dict[str, Any]:
        if self.ids_log is not None:
            self.ids_log.close()
        self.tracker.close()
        summary = {"step": self.step, "epoch": self.state.epoch, "tokens_seen": self.tokens_seen,
                   "out": str(self.cfg.out)}
        if last_val is not None:
            summary.update(val_loss=round(last_val["loss"], 4), val_acc0=round(last_val["acc"][0], 4),
                           val_tau=round(last_val["tau"], 3))
        if self.accelerator.is_main_process:
            print("redraft train done: " + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()  # finishes wandb and destroys the process group
        return summary


# ============================================================================ main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_cli(list(sys.argv[1:] if argv is None else argv))
    check_data(cfg)  # a bad --data is refused before OUT is created
    data_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # and a sequence_parallel the launch cannot split
    with output_lock(cfg.out, main_process=int(os.environ.get("RANK", "0")) == 0):
        return _train(cfg)


def check_data(cfg: TrainConfig) -> None:
    """A finished dataset's manifest exists and counts samples (a --stream folder may not exist yet)."""
    if cfg.stream:
        return
    from redraft.core.dataset.format import MANIFEST_NAME, DatasetError, load_manifest

    manifest = load_manifest(Path(cfg.data))
    if not manifest.get("num_samples"):
        raise DatasetError(f"{Path(cfg.data) / MANIFEST_NAME}: the dataset holds no sample (its extraction skipped "
                           f"every record: {manifest.get('skipped') or 'none counted'})")


def _train(cfg: TrainConfig) -> dict[str, Any]:
    from accelerate.utils import set_seed

    from redraft.core.drafter.sequence_parallel import sequence_groups
    from train.data import build_data
    from train.drafter_setup import build_drafter, read_lm_head
    from train.stream import build_stream
    from train.ttt import TTTModel

    cfg, point = plan_resume(cfg)
    accelerator = make_accelerator(cfg)
    setup_logging(accelerator.process_index, accelerator.is_main_process)
    log.info("world size %d, distributed type %s, device %s", accelerator.num_processes,
             accelerator.distributed_type, accelerator.device)
    set_seed(cfg.seed)

    dp_world = data_world(cfg, accelerator.num_processes)
    dp_rank = accelerator.process_index // cfg.sequence_parallel
    if cfg.data_order == "stream":  # a resumed stream keeps its schedule's length
        data = build_stream(cfg, dp_rank, dp_world, accelerator, None if point is None else point.total_steps)
    else:
        data = build_data(cfg, dp_rank, dp_world)
    built = build_drafter(cfg, data.reader, None if point is None else point.folder)
    # this rank's group (None without one); TTTModel refuses kv heads it does not divide
    sp = sequence_groups(accelerator.num_processes, cfg.sequence_parallel, accelerator.process_index)
    lm_head = read_lm_head(built, accelerator.device) if data.teacher == "last_hidden" else None
    model = TTTModel(built.drafter, steps=cfg.ttt_steps, decay=cfg.ttt_decay, teacher=data.teacher, lm_head=lm_head,
                     teacher_chunk_tokens=cfg.teacher_chunk_tokens, recompute=cfg.activation_checkpointing,
                     sequence_parallel=sp)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("drafter: %s, %.2fM trainable parameters", built.drafter.config, n_train / 1e6)

    optimizer, scheduler = build_optimizer(cfg, model, data.total_steps)
    configure_deepspeed(accelerator, cfg, universal=point is not None and point.elastic)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler's state goes into trainer_state.json, not register_for_checkpointing: accelerate
    # unpickles registered objects with weights_only=False, and a checkpoint must not be able to run code.
    trainer = Trainer(cfg, accelerator, data, model, optimizer, scheduler, run_record(cfg, data, built.warm_start))
    trainer.resume(point)
    return trainer.fit()


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    # a bad option, dataset or checkpoint (a second trainer on OUT included): one line, exit 2
    return ending.run(lambda: main(argv), logging.getLogger("train"))


if __name__ == "__main__":
    sys.exit(cli())
