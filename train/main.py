"""Train an EAGLE-3 drafter on a redraft dataset: setup -> data -> model -> optimizer -> loop -> save.

    accelerate launch [--config_file configs/accelerate/X.yaml] train/main.py --config configs/demo/train.yaml \
        [--data D --out O --max-steps N --resume auto --init-from DIR --report-to none] [--any_field value]
    python train/main.py ...        # one process, same code
    python -m train.main --help     # every option

The code is identical for one CPU process, CPU DeepSpeed over gloo and 8 GPUs: DeepSpeed (ZeRO-2)
comes only from the accelerate config file. Batches are built by train/data.py and sharded by
rank there (never by accelerate.prepare), so resume replays the exact data order.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script path: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from train.config import TrainConfig, parse_cli  # noqa: E402

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


def configure_deepspeed(accelerator: Any, cfg: TrainConfig) -> None:
    """Fill the DeepSpeed json's "auto" values from the TrainConfig; refuse contradictions and ZeRO-3."""
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


def target_info(manifest: dict, target_path: Path) -> dict[str, Any]:
    """DrafterConfig.from_target's input: sizes from the manifest, heads/MLP/rope from the target config."""
    from core.drafter.config import MLA_FIELDS
    from core.target_weights import text_config

    cfg_file = target_path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{cfg_file}: target config not found (manifest target.path={manifest['target'].get('path')!r}); "
            "pass --target_path to the target model folder"
        )
    raw = json.loads(cfg_file.read_text())
    raw_text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    try:
        from transformers import AutoConfig

        text = text_config(AutoConfig.from_pretrained(str(target_path), local_files_only=True)).to_dict()
    except Exception as e:  # custom architectures (trust_remote_code) or wrappers unknown here
        log.info("AutoConfig could not read %s (%s); using config.json as is", target_path, e)
        text = raw_text
    for key in ("hidden_size", "vocab_size"):
        if key in text and int(text[key]) != int(manifest[key]):
            raise ValueError(f"{cfg_file}: {key}={text[key]} but the dataset manifest says {manifest[key]}")
    return {
        "hidden_size": int(manifest["hidden_size"]),
        "num_layers": int(manifest["num_layers"]),
        "vocab_size": int(manifest["vocab_size"]),
        "aux_layer_ids": list(manifest["aux_layer_ids"]),
        "architecture": manifest["target"].get("architecture") or (raw.get("architectures") or [None])[0],
        "num_attention_heads": text.get("num_attention_heads"),
        "num_key_value_heads": text.get("num_key_value_heads"),
        "head_dim": raw_text.get("head_dim"),  # DeepseekV3Config.head_dim is the rope dim: trust only the file
        "intermediate_size": text.get("intermediate_size"),
        "rms_norm_eps": text.get("rms_norm_eps"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "hidden_act": text.get("hidden_act"),
        "rope": {k: text[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if text.get(k) is not None},
        # an MLA target's latent sizes: what an MLA drafter copies (DeepSeek-V3, Kimi-K2.5)
        "mla": {k: text[k] for k in MLA_FIELDS if text.get(k) is not None} if text.get("kv_lora_rank") else None,
    }


FINGERPRINT_KEYS = ("tokenizer_hash", "chat_template_hash")


def check_init_fingerprint(init_from: Path, manifest: dict, data: str) -> None:
    """Refuse --init-from a redraft drafter trained on data of another tokenizer or chat template.

    Shapes can agree while token ids mean different things (same vocab size, other tokenizer):
    the drafter's d2t mapping and everything it learnt would then be silently wrong. Foreign
    folders (no redraft.json) carry no fingerprint; only their shapes are checked.
    """
    from core.drafter.folder import REDRAFT_RECORD, CheckpointError

    path = init_from / REDRAFT_RECORD
    if not path.is_file():
        return
    try:
        recorded = (json.loads(path.read_text()).get("dataset") or {})
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    problems = [
        f"{key}: {init_from} was trained on {recorded[key]!r}, {data} has {manifest.get(key)!r}"
        for key in FINGERPRINT_KEYS
        if recorded.get(key) and manifest.get(key) and recorded[key] != manifest[key]
    ]
    if problems:
        raise CheckpointError(f"--init-from {init_from} does not fit the data: " + "; ".join(problems))


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
    """INFO on rank 0, warnings elsewhere; leaves an existing configuration (pytest, a caller) alone."""
    if logging.getLogger().handlers:
        return
    logging.basicConfig(
        level=logging.INFO if main_process else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(name)s %(levelname)s: %(message)s",
    )


# ============================================================================ main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_cli(list(sys.argv[1:] if argv is None else argv))

    # ---------------------------------------------------------------- setup
    from accelerate.utils import set_seed

    from core.dataset.batch import collate
    from core.dataset.reader import DatasetReader
    from core.drafter.config import MLA_FIELDS, DrafterConfig
    from core.drafter.folder import WEIGHTS_NAME, load_drafter_checkpoint, read_record
    from core.drafter.modeling import Eagle3Drafter
    from core.drafter.serving_format import load_serving_weights
    from core.drafter.vocab import build_vocab_mapping
    from core.target_weights import read_target_tensor, weight_key_candidates
    from train.checkpoint import (
        check_init_compatible,
        find_resume_checkpoint,
        read_trainer_state,
        save_checkpoint,
    )
    from train.data import DistributedBucketSampler, FeatureDataset, SamplerState, split_by_id
    from train.tracking import StepStats, Tracker
    from train.ttt import TTTModel
    from train.warm_start import warm_start

    accelerator = make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    setup_logging(rank, accelerator.is_main_process)
    log.info("world size %d, distributed type %s, device %s", world, accelerator.distributed_type, accelerator.device)
    out = Path(cfg.out)
    set_seed(cfg.seed)

    # ---------------------------------------------------------------- data
    reader = DatasetReader(cfg.data)
    manifest = reader.manifest
    teacher_kind = cfg.teacher
    if teacher_kind == "auto":
        teacher_kind = "topk" if reader.has_topk else "last_hidden"
    if (teacher_kind == "topk" and not reader.has_topk) or (teacher_kind == "last_hidden" and not reader.has_last_hidden):
        raise ValueError(f"teacher={teacher_kind} but {cfg.data} stores teacher {manifest.get('teacher')}")
    lengths = [min(n, cfg.max_length) if cfg.max_length > 0 else n for n in reader.lengths]
    train_idx, val_idx = split_by_id(reader.sample_ids, cfg.val_fraction, cfg.val_max_samples, cfg.seed)
    batching = dict(tokens_per_batch=cfg.tokens_per_batch, max_samples=cfg.micro_batch_size,
                    mega_batch_samples=cfg.mega_batch_samples, seed=cfg.seed, rank=rank, world_size=world)
    sampler = DistributedBucketSampler(train_idx, lengths, grad_accum=cfg.grad_accum, **batching)
    val_sampler = DistributedBucketSampler(val_idx, lengths, shuffle=False, **batching)
    sampler.check_trainable(cfg.data)
    total_steps = cfg.max_steps or sum(sampler.steps_in_epoch(e) for e in range(cfg.num_epochs))
    dataset = FeatureDataset(reader)
    in_dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    log.info("data: %d train / %d val samples, %d steps/epoch/rank, %d total steps, teacher %s",
             len(train_idx), len(val_idx), sampler.steps_in_epoch(0), total_steps, teacher_kind)

    def loader(batches: list[list[int]]) -> DataLoader:
        return DataLoader(dataset, batch_sampler=batches, num_workers=cfg.num_workers,
                          collate_fn=functools.partial(collate, max_length=cfg.max_length))

    # ---------------------------------------------------------------- model
    target_path = Path(cfg.target_path or manifest["target"]["path"])
    info = target_info(manifest, target_path)
    names = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "max_position_embeddings", "rope_theta", *MLA_FIELDS)
    overrides = {k: getattr(cfg, k) for k in names if getattr(cfg, k) is not None}
    wanted = DrafterConfig.from_target(
        info, cfg.draft_vocab_size, attention=cfg.drafter_attention,
        torch_dtype="bfloat16" if cfg.dtype == "bf16" else "float32", **overrides
    )
    ckpt = find_resume_checkpoint(out, cfg.resume)
    init_state = None
    if cfg.init_from:
        init_cfg, init_state = load_drafter_checkpoint(
            cfg.init_from, target_architecture=wanted.target_architecture, target_num_layers=wanted.target_num_layers
        )
        # shapes tied to the data must agree; architecture fields come from the init drafter unless overridden.
        # A rebuilt draft vocabulary takes this run's draft_vocab_size, as a scratch run does.
        rebuild = cfg.warm_start_vocab == "rebuild"
        fields = ("attention", "hidden_size", "target_hidden_size", "vocab_size",
                  *(() if rebuild else ("draft_vocab_size",)),
                  "aux_layer_ids", *[k for k in overrides if k not in ("max_position_embeddings", "rope_theta")])
        check_init_compatible(init_cfg, wanted, cfg.init_from, fields)
        check_init_fingerprint(Path(cfg.init_from), manifest, cfg.data)
        drafter_cfg = DrafterConfig.from_dict({
            **init_cfg.to_dict(), "target_architecture": wanted.target_architecture,
            "target_num_layers": wanted.target_num_layers, "torch_dtype": wanted.torch_dtype,
            **{k: v for k, v in overrides.items() if k in ("max_position_embeddings", "rope_theta")},
            **({"draft_vocab_size": wanted.draft_vocab_size} if rebuild else {}),
        })
    else:
        drafter_cfg = wanted
    drafter = Eagle3Drafter(drafter_cfg)
    embed_keys, head_keys = weight_key_candidates(json.loads((target_path / "config.json").read_text()))
    drafter.load_target_embedding(target_path, embed_keys)
    drafter.embed_tokens.weight.requires_grad_(False)
    warm_info = None
    if ckpt is not None:
        # Resume restores the run's own checkpoint exactly (training_state/ below): neither the warm start nor the
        # vocabulary is redone, so the vocabulary is the one the run was trained with, whatever the counts say now.
        drafter.load_serving_state_dict(load_serving_weights(ckpt / WEIGHTS_NAME))
        warm_info = (read_record(ckpt) or {}).get("warm_start")
        if cfg.init_from:
            log.info("resuming %s: --init-from %s is not applied again (the checkpoint holds the warm-started "
                     "drafter)", ckpt, cfg.init_from)
    elif init_state is not None:
        warm_info = warm_start(drafter, init_state, reader.token_counts(), cfg.warm_start_vocab, cfg.init_from)
    else:
        drafter.set_vocab_mapping(*build_vocab_mapping(reader.token_counts(), drafter_cfg.draft_vocab_size))
    lm_head = None
    if teacher_kind == "last_hidden":
        lm_head = read_target_tensor(target_path, head_keys)[0].to(accelerator.device)
    model = TTTModel(drafter, steps=cfg.ttt_steps, decay=cfg.ttt_decay, teacher=teacher_kind, lm_head=lm_head,
                     teacher_chunk_tokens=cfg.teacher_chunk_tokens)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("drafter: %s, %.2fM trainable parameters", drafter_cfg, n_train / 1e6)

    # ---------------------------------------------------------------- optimizer
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
    )
    # Stepped by hand once per optimizer step (accelerate's prepared scheduler steps world-size times).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    )
    configure_deepspeed(accelerator, cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler's state goes into trainer_state.json, not register_for_checkpointing: accelerate
    # unpickles registered objects with weights_only=False, and a checkpoint must not be able to run code.
    unwrapped = accelerator.unwrap_model(model)

    # ---------------------------------------------------------------- resume
    step, state = 0, SamplerState()
    tokens_seen, last_saved = 0, -1
    if ckpt is not None:
        ts = read_trainer_state(ckpt)
        if int(ts["world_size"]) != world:
            raise ValueError(f"{ckpt}: saved with world size {ts['world_size']}, this run has {world}")
        pickled = sorted((ckpt / "training_state").glob("custom_checkpoint_*.pkl"))
        if pickled:
            raise ValueError(f"{pickled[0]}: a pickled LR scheduler from an older redraft (not loaded: pickles can "
                             "run code); delete the file to resume, the schedule is recomputed from the step")
        accelerator.load_state(str(ckpt / "training_state"))
        step, state = int(ts["step"]), SamplerState(int(ts["epoch"]), int(ts["position"]))
        tokens_seen = int(ts.get("tokens_seen", 0))
        if "scheduler" in ts:
            scheduler.load_state_dict(ts["scheduler"])
        else:  # older checkpoints: LambdaLR is a pure function of the step count
            for _ in range(step):
                scheduler.step()
        last_saved = step
        log.info("resumed from %s: step %d, epoch %d, position %d", ckpt, step, state.epoch, state.position)
    elif cfg.resume == "auto":
        log.info("resume=auto: no checkpoint under %s, starting fresh", out)

    record = {
        "format": "redraft-checkpoint",
        "dataset": {
            "path": str(Path(cfg.data).resolve()),
            "tokenizer_hash": manifest.get("tokenizer_hash"),
            "chat_template_hash": manifest.get("chat_template_hash"),
            "target_config_hash": manifest["target"].get("config_hash"),
            "target_name": manifest["target"].get("name"),
            "num_samples": len(reader),
            "teacher": teacher_kind,
        },
        "val_ids": [reader.sample_ids[i] for i in val_idx],
        "train_config": cfg.to_dict(),
    }
    if warm_info is not None:
        record["warm_start"] = warm_info
    tracker = Tracker(accelerator, out, config=cfg.to_dict(), total_steps=total_steps, start_step=step,
                      report_to=cfg.report_to, project=cfg.wandb_project, run_name=cfg.run_name or out.name)
    ids_log = None
    if cfg.log_sample_ids:
        (out / "sample_ids").mkdir(parents=True, exist_ok=True)
        ids_log = open(out / "sample_ids" / f"rank-{rank}.jsonl", "a")

    def evaluate() -> dict[str, Any] | None:
        batches = val_sampler.rank_batches(0)
        if not batches:
            return None
        stats = StepStats(cfg.ttt_steps, accelerator.device)
        model.eval()
        with torch.no_grad():
            for batch in loader(batches):
                stats.add(model(batch.to(accelerator.device, in_dtype)), batch.num_tokens, int(batch.loss_mask.sum()))
        model.train()
        return stats.summary(accelerator)

    def save() -> Path:
        trainer_state = {"step": step, "epoch": state.epoch, "position": state.position, "world_size": world,
                         "tokens_seen": tokens_seen, "total_steps": total_steps, "scheduler": scheduler.state_dict()}
        return save_checkpoint(accelerator, out, step, drafter=unwrapped.drafter, record={**record, "step": step},
                               trainer_state=trainer_state, keep_last=cfg.keep_last)

    # ---------------------------------------------------------------- loop
    model.train()
    stats = StepStats(cfg.ttt_steps, accelerator.device)
    t_window, last_val = time.perf_counter(), None
    grad_norm: Any = float("nan")  # a device tensor between log steps: float() only when logged (no host sync)
    end_step = min(total_steps, cfg.stop_at_step) if cfg.stop_at_step > 0 else total_steps
    while step < end_step:
        for batch in loader(sampler.remaining(state)):
            state.position += 1
            with accelerator.accumulate(model):
                out_ttt = model(batch.to(accelerator.device, in_dtype))
                accelerator.backward(out_ttt.loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    grad_norm = norm.detach() if isinstance(norm, torch.Tensor) else norm
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            stats.add(out_ttt, batch.num_tokens, int(batch.loss_mask.sum()))
            tokens_seen += batch.num_tokens
            if ids_log is not None:
                ids_log.write(json.dumps({"epoch": state.epoch, "position": state.position,
                                          "ids": batch.sample_ids}) + "\n")
            if not accelerator.sync_gradients:
                continue
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0 or step == total_steps:
                m = stats.summary(accelerator)
                elapsed = time.perf_counter() - t_window
                m.update(lr=lr, grad_norm=float("nan") if grad_norm is None else float(grad_norm), epoch=state.epoch,
                         tokens_per_s=m["tokens"] / max(elapsed, 1e-9))
                tracker.log("train", step, m)
                tracker.progress(step, m)
                stats.reset()
                t_window = time.perf_counter()
            else:
                tracker.progress(step)
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == total_steps:
                last_val = evaluate()
                if last_val is not None:
                    tracker.log("val", step, last_val)
            if (cfg.save_every and step % cfg.save_every == 0) or step == end_step:
                save()
                last_saved = step
            if step >= end_step:
                break
        else:
            state.epoch, state.position = state.epoch + 1, 0
    if last_saved != step:
        save()

    # ---------------------------------------------------------------- done
    if ids_log is not None:
        ids_log.close()
    tracker.close()
    summary = {"step": step, "epoch": state.epoch, "tokens_seen": tokens_seen, "out": str(out)}
    if last_val is not None:
        summary.update(val_loss=round(last_val["loss"], 4), val_acc0=round(last_val["acc"][0], 4),
                       val_tau=round(last_val["tau"], 3))
    if accelerator.is_main_process:
        print("redraft train done: " + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # finishes wandb and destroys the process group
    return summary


if __name__ == "__main__":
    main()
