"""The serving stage: what a drafter does for a running engine's users.

``python -m serve.bench`` measures running SGLang/vLLM servers (tokens/s, the engine's own acceptance);
``python -m serve.tune`` sweeps speculative settings on fresh servers and answers which to serve with. Its
inputs are the upstream stages' files: a dataset (``python -m extract``), drafter exports (``python -m
eval.export``) and an offline acceptance report (``python -m eval.acceptance --json``);
``python -m redraft.pipeline.tune`` makes them and runs it in one command.
"""
