"""From a drafter checkpoint and the user's prompts to which speculative setting to serve, in one command.

    python -m redraft.pipeline.tune DRAFTER --target T --prompts traffic.jsonl [--engine vllm|sglang] \\
        [--steps 1,2,3,4,5] [--concurrency 1,4,16] [--repeats 3] --out runs/tune

Each stage runs as its own process, exactly as a user would type it (the commands are logged), and they meet
only in the files they write under OUT:

1. ``python -m extract --regenerate``: the prompts (anything ``extract --data`` reads, or a built-in name such
   as ``mtbench``) answered by the target, greedily, and captured at the drafter's layers into OUT/traffic
   (reused when complete and made by the same command). ``--data`` names such a dataset made earlier instead;
2. ``python -m eval.export``: the drafter in each engine's layout, OUT/export/export-{sglang,vllm} (an export
   given as DRAFTER is used as is for its engine);
3. ``python -m eval.acceptance --json``: offline tau for chains of 1..max(--steps) drafts on the traffic's
   samples (vLLM's walk), OUT/offline.json;
4. ``python -m serve.tune``: probes, the sweep on fresh servers of ``--engine`` and the answer, OUT/report.*.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from redraft.catalog.builtin import resolve_target
from redraft.core import options
from redraft.core.config import ConfigError
from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.folder import CheckpointError, load_drafter_checkpoint, resolve_drafter_folder
from redraft.core.drafter.serving_format import serving_engines
from redraft.core.options import option
from redraft.core.target_weights import text_config
from redraft.engines.launch import ENGINES, export_engine
from redraft.pipeline.stages import run_command, run_stage
from serve.tune import TuneOptions  # its options are passed on, not its code run

log = logging.getLogger("redraft.pipeline.tune")
PROG = "python -m redraft.pipeline.tune"


@dataclass(kw_only=True)
class PipelineTuneOptions(TuneOptions):
    """serve.tune's options, with the drafter as a checkpoint and the traffic as prompts; what this command
    makes (the exports and the offline report) is not an option here."""

    drafter: str = option(help="training run, checkpoint or export (python -m eval.export)", group="inputs",
                          positional=True, metavar="DRAFTER")
    data: str | None = option(None, "the traffic as a dataset made earlier by python -m extract --regenerate "
                                    "(instead of --prompts)", group="inputs")
    offline: str = dataclasses.field(default="")  # made by stage 3
    exports: list[str] = dataclasses.field(default_factory=list)  # made by stage 2
    prompts: str | None = option(None, "the traffic: a file python -m extract --data reads, or a built-in name "
                                       "(mtbench); answered by the target into OUT/traffic", group="inputs")
    max_tokens: int = option(128, "new tokens per answer when --prompts are answered (--data keeps the budget its "
                                  "answers were written with)", group="inputs")
    regen_backend: str = option("vllm", "who answers the --prompts (extract --regen-backend)", group="inputs",
                                choices=("hf", "vllm"))
    engine: str = option("vllm", "the engine swept: vllm, or sglang (on a CPU: the SGLang CPU venv, redraft's "
                                 "stand-in for its kernels)", group="engine", choices=ENGINES)

    def validate(self) -> None:
        super().validate()
        if (self.prompts is None) == (self.data is None):
            raise ConfigError("give the traffic as --prompts FILE_OR_NAME or as --data DATASET (one of them)")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.data is not None and not (Path(self.data) / "manifest.json").is_file():
            raise ConfigError(f"--data {self.data}: no manifest.json (not a dataset written by python -m extract)")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(PipelineTuneOptions, prog=PROG, description=__doc__.split("\n")[0])


# ----------------------------------------------------------------------------- stages


def drafter_config(opts: PipelineTuneOptions, target: Path) -> DrafterConfig:
    """The drafter's config: the target layers it reads (redraft's convention, ``redraft.core.layers``), so the traffic
    captures those, and its method, which decides the engines it is exported for and may be tuned in."""
    tcfg = json.loads((target / "config.json").read_text())
    try:
        folder = resolve_drafter_folder(opts.drafter)
        cfg, _ = load_drafter_checkpoint(folder, target_architecture=(tcfg.get("architectures") or ["?"])[0],
                                         target_num_layers=int(text_config(tcfg)["num_hidden_layers"]))
    except (CheckpointError, ValueError) as e:
        raise ConfigError(f"DRAFTER {opts.drafter}: {e}") from None
    if opts.engine not in serving_engines(cfg):
        raise ConfigError(f"--engine {opts.engine}: DRAFTER {opts.drafter} is a {cfg.method} drafter, which only "
                          f"{' and '.join(serving_engines(cfg))} serve{'s' if len(serving_engines(cfg)) == 1 else ''}")
    return cfg


def extract_command(opts: PipelineTuneOptions, target: Path, out: Path, layer_ids: list[int]) -> list[str]:
    """``python -m extract`` answering each first user turn with the target (greedy) and capturing it."""
    return [sys.executable, "-m", "extract", "--target", str(target), "--data", str(opts.prompts), "--out", str(out),
            "--aux-layer-ids", ",".join(map(str, layer_ids)), "--teacher", "topk", "--hidden-dtype", "bf16",
            "--max-length", str(opts.max_model_len), "--dtype", "float32", "--max-samples", str(opts.num_prompts),
            "--regenerate", "--max-user-turns", "1", "--temperature", "0", "--max-new-tokens", str(opts.max_tokens),
            "--regen-backend", opts.regen_backend]


def traffic_stage(opts: PipelineTuneOptions, target: Path, out: Path, layer_ids: list[int]) -> Path:
    """OUT/traffic: the prompts answered and captured (reused when complete and made by the same command)."""
    if opts.data is not None:
        return Path(opts.data)
    folder = out / "traffic"
    cmd = extract_command(opts, target, folder, layer_ids)
    stamp = out / "traffic.command.json"
    same_command = stamp.is_file() and json.loads(stamp.read_text()) == cmd[1:]
    if same_command and (folder / "manifest.json").is_file() and subprocess.run(
            [sys.executable, "-m", "extract.verify", str(folder)], capture_output=True).returncode == 0:
        log.info("traffic: reusing %s", folder)
        return folder
    run_stage(cmd, logfile=out / "traffic.log")
    stamp.write_text(json.dumps(cmd[1:]) + "\n")
    return folder


def export_stage(opts: PipelineTuneOptions, target: Path, out: Path, engines: Sequence[str]) -> dict[str, str]:
    """engine -> the drafter in that engine's layout (DRAFTER itself when it is that engine's export), for each
    engine that serves it."""
    given = export_engine(Path(opts.drafter))
    exports = {}
    for engine in engines:
        if engine == given:
            exports[engine] = opts.drafter
            continue
        folder = out / "export" / f"export-{engine}"
        run_stage([sys.executable, "-m", "eval.export", opts.drafter, str(folder), "--format", engine,
                   "--target", str(target), "--dtype", "fp32", "--force", "--quiet"])
        exports[engine] = str(folder)
    return exports


def offline_stage(opts: PipelineTuneOptions, data: Path, out: Path) -> Path:
    """OUT/offline.json: eval.acceptance on the traffic's first NUM_PROMPTS samples, chains up to the longest."""
    report = out / "offline.json"
    run_stage([sys.executable, "-m", "eval.acceptance", opts.drafter, "--data", str(data), "--split", "all",
               "--max-samples", str(opts.num_prompts), "--steps", str(max(opts.chains())), "--engine", "vllm",
               "--json", str(report), "--no-progress"])
    return report


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = options.parse(PipelineTuneOptions, argv, prog=PROG, description=__doc__.split("\n")[0], section="tune")
    target = resolve_target(opts.target)
    cfg = drafter_config(opts, target)  # a bad DRAFTER, or one --engine does not serve, is refused before anything runs
    out = Path(opts.out)
    data = traffic_stage(opts, target, out, [int(i) for i in cfg.aux_layer_ids])
    exports = export_stage(opts, target, out, serving_engines(cfg))
    offline = offline_stage(opts, data, out)
    served = exports[opts.engine]
    others = [folder for engine, folder in exports.items() if engine != opts.engine]
    passed_on = options.to_argv(opts, TuneOptions, skip=("drafter", "data", "offline", "exports", "target"))
    run_stage([sys.executable, "-m", "serve.tune", served, "--target", str(target), "--data", str(data),
               "--offline", str(offline), *[a for o in others for a in ("--exports", o)], *passed_on])
    return 0


def cli(argv: list[str] | None = None) -> int:
    """The command line: a mistake is one line and exit 2; a failed stage ends with that stage's exit code."""
    return run_command(main, argv, log)


if __name__ == "__main__":
    sys.exit(cli())
