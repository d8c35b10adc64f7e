"""Moved: tuning from a checkpoint and prompts is ``python -m pipeline.tune`` (its last stage is the serving
stage's ``python -m serve.tune``). This old path forwards to it, with a note, so that scripts written against it
keep working."""

import runpy
import sys

if __name__ == "__main__":
    print("note: python -m eval.tune is now python -m pipeline.tune (forwarding)", file=sys.stderr)
    runpy.run_module("pipeline.tune", run_name="__main__", alter_sys=True)
