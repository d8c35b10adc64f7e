#!/usr/bin/env python3
"""SpecForge 0.2.0's training step on a benchmark case, timed: the other side of train_throughput.py --specforge.

    SF_VENV/bin/python benchmarks/specforge_train_step.py CASE [--threads 2] [--warmup 1] [--repeats 2] [--ttt 7]

Runs in SpecForge's own venv (built by ``conformance/make_venv.sh specforge``; the conformance lane's)
and imports nothing from redraft's product code. SpecForge is driven as a black box through the
lane's reference ``conformance/specforge_ref.py`` (its import-time stubs, checkpoint loading and
offline data path):
the drafter (``LlamaForCausalLMEagle3``, sdpa attention backend), the TTT unroll
(``OnlineEagle3Model``) and the loss (``Eagle3TrainStrategy.forward_loss``) are SpecForge's. Its
Triton loss kernel cannot run on a CPU, so it is replaced by SpecForge's own eager reference loss
(``specforge.core.loss._compute_loss``), as the lane's reference does; torch.compile is off.

One step = ``forward_loss`` + ``backward`` + SpecForge's own optimizer step (``BF16Optimizer``, what
its trainer always builds: gradient norm and clipping at 0.5, AdamW over fp32 master copies, the
copy back), as redraft's step is forward + backward + clipping + AdamW.
CASE (written by benchmarks/train_sidebyside.py) holds ``specforge-ckpt/`` (config.json +
model.safetensors) and ``inputs.safetensors`` (ids, fp32 aux features, embedding, masks and the
teacher as top-k ids/log-probs). The teacher reaches SpecForge as full-vocabulary logits (what
its TargetHead delivers): the top-k log-probs, -1e4 elsewhere (exp underflows to exactly 0, so
the distribution is the top-k one). Prints one JSON line: step times, CPU times, losses and
memory (VmRSS after set-up, VmHWM over the steps after a reset, ru_maxrss of the process).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from pathlib import Path

from redraft.core import cli as ending


def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-grad-norm", type=float, default=0.5)
    a = ap.parse_args(argv)

    import torch

    from conformance import specforge_ref as ref  # first: it turns torch.compile off before torch loads

    sf = ref.import_specforge()
    torch.set_num_threads(a.threads)
    from safetensors.torch import load_file

    x = load_file(str(a.case / "inputs.safetensors"))
    bsz, seq = x["input_ids"].shape
    vocab = x["embed_weight"].shape[0]
    teacher = torch.full((bsz, seq, vocab), -1e4, dtype=torch.float32)
    teacher.scatter_(-1, x["topk_ids"].long(), x["topk_logprobs"].float())
    model = ref.load_drafter(sf, a.case / "specforge-ckpt", x["embed_weight"])
    model.train()
    inputs = {"input_ids": x["input_ids"].long(), "aux_hidden_states": x["aux_hidden_states"].float(),
              "loss_mask": x["loss_mask"], "teacher_logprobs": teacher}
    feats = ref.raw_batch(sf, inputs, x["attention_mask"].long())
    del teacher, inputs
    eagle = sf["OnlineEagle3Model"](model, length=a.ttt, attention_backend="sdpa")
    strategy = sf["Strategy"](eagle, target_head=ref.identity_head(sf))
    batch = sf["TrainBatch"](sample_ids=[f"s{i}" for i in range(bsz)], strategy="eagle3", tensors=feats,
                             metadata={"target_repr": "hidden_state"})
    from specforge.optimizer import BF16Optimizer

    optimizer = BF16Optimizer(model, lr=a.lr, max_grad_norm=a.max_grad_norm, total_steps=1000)

    def step() -> float:
        out = strategy.forward_loss(batch)
        out.loss.backward()
        optimizer.step()  # clips, steps AdamW on the fp32 masters, copies back, clears the gradients
        return float(out.loss)

    rss_before = _status_kb("VmRSS") * 1024
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak below is the steps' own
    losses, step_times, cpu_times = [], [], []
    for i in range(a.warmup + a.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        if i >= a.warmup:
            step_times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    print(json.dumps({
        "side": "specforge", "specforge_version": sf["version"], "torch": torch.__version__,
        "step_times": step_times, "cpu_times": cpu_times, "losses": losses, "rss_before": rss_before,
        "step_peak": _status_kb("VmHWM") * 1024,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.specforge_train_step")))
