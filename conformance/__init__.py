"""The conformance lane (``make conformance``): our exports in the real SGLang/vLLM loaders, our numerics vs SpecForge.

Scripts here run in the project's own venv and call the peer tools in ``shared/tools`` through
their own venvs; nothing here is imported by the product.
"""
