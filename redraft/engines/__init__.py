"""Serving engines as token-ids-in, token-ids-out generators, for every stage that needs one.

- :mod:`redraft.engines.vllm`: the one vLLM runner (in-process, or a driver subprocess under the vLLM
  CPU venv's interpreter); ``eval.online`` and ``extract --regen-backend vllm`` both use it.
- :mod:`redraft.engines.vllm_driver`: the driver that runs under the engine's interpreter (stdlib + vLLM).
- :mod:`redraft.engines.server`: a running SGLang (``/generate``) or vLLM (``/v1/completions``) server,
  asked concurrently with retries (``extract --regen-backend server``).

Requests are :class:`redraft.engines.request.TokenRequest`: prompt ids, a token budget, the sampling, and
the ids to stop at. Nothing is decoded and re-encoded on the way.
"""
