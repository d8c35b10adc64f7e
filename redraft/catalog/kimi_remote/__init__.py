"""The model code a wrapped kimi-k25-mini folder ships (copied next to its config.json by redraft.catalog.kimi_mini.served.write_wrapped).

Kimi-K2.5's checkpoint is served as ``KimiK25ForConditionalGeneration`` from its own code (``auto_map``,
loaded with ``trust_remote_code``), and so is its processor. These files are the miniature's equivalent:
``configuration_kimi_k25.py`` and ``modeling_kimi_k25.py`` (the text model under ``language_model`` and a vision
stand-in that is never run on text), ``kimi_k25_processor.py`` and ``kimi_k25_vision_processing.py`` (the
processor ``AutoProcessor`` loads from ``preprocessor_config.json``, which engines read while they start). They
import only torch and transformers (and each other, relatively), as remote code must.
"""
