"""The model code a wrapped kimi-k25-mini folder ships (copied next to its config.json by catalog.kimi_mini.write_wrapped).

Kimi-K2.5's checkpoint is served as ``KimiK25ForConditionalGeneration`` from its own code (``auto_map``,
loaded with ``trust_remote_code``). These two files are the miniature's equivalent: the text model under
``language_model`` and a vision stand-in that is never run on text. They import only torch and transformers
(and each other, relatively), as remote code must.
"""
