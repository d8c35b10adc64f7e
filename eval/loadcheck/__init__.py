"""The engine-loading check, run by a python that has the engine (the serving box, or the lane's engine venv).

``python -m eval.verify_engine`` is its command line (and ``eval.export --verify-with``); the CI lane runs
every export through it. The pieces, one job each:

- ``folder``: reads a drafter folder (config.json + model.safetensors) and says which EAGLE-3
  architecture it is; every refusal names the file and the key;
- ``probe``: what a load wrote: sentinel fill, unwritten row ranges named by shard, per-key traces,
  the draft->target vocabulary map, the report and its VERDICT line;
- ``check``: the engine-independent procedure (build, sentinel, full load, key by key);
- ``sglang_engine`` / ``vllm_engine``: each engine's own model class and loader, set up on CPU;
- ``targets``: the target config vLLM needs (given, or synthesised from the draft).

Nothing here imports ``core``: the check judges an export with code that does not share the exporter's
tables (``redraft.core.drafter.serving_format``) or its assumptions.
"""
