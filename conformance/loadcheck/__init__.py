"""The engine-loading check of the conformance lane, run by the engine venv's python.

``conformance/engine_load.py`` is its command line. The pieces, one job each:

- ``folder``: reads a drafter folder (config.json + model.safetensors) and says which EAGLE-3
  architecture it is; every refusal names the file and the key;
- ``probe``: what a load wrote: sentinel fill, unwritten row ranges named by shard, per-key traces,
  the draft->target vocabulary map, the report and its VERDICT line;
- ``check``: the engine-independent procedure (build, sentinel, full load, key by key);
- ``sglang_engine`` / ``vllm_engine``: each engine's own model class and loader, set up on CPU;
- ``targets``: the target config vLLM needs (given, or synthesised from the draft).

Nothing here imports the product (``core``, ``eval``): the lane judges our exports with code that
does not share their assumptions.
"""
