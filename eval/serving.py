"""Moved: the serving benchmark is ``python -m serve.bench`` (the serving stage, ``serve/``). This old path
forwards to it, with a note, so that scripts written against it keep working."""

import runpy
import sys

if __name__ == "__main__":
    print("note: python -m eval.serving is now python -m serve.bench (forwarding)", file=sys.stderr)
    runpy.run_module("serve.bench", run_name="__main__", alter_sys=True)
