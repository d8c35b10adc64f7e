"""The conformance lane (``make conformance``): our exports in the real SGLang/vLLM loaders, our numerics vs SpecForge.

Everything the lane runs is here: the venv builder and its locks (``make_venv.sh``, ``venvs/``), the
engine-loading check run by the engine venv (``python -m eval.verify_engine``, ``eval/loadcheck/``), SpecForge's
reference run by the SpecForge venv (``specforge_ref.py``), the drafters they judge
(``make_drafters.py``, ``foreign_drafter.py``) and the comparisons run by the project's venv
(``check_engines.py``, ``check_specforge.py``, ``check_regen_api.py``). Nothing here is imported by
the product.
"""
