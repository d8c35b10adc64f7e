"""redraft's shared core: what every stage uses, so that no stage imports another stage's code.

The two contracts between the stages live here: the dataset folder (:mod:`redraft.core.dataset`) and the
drafter with its serving folder (:mod:`redraft.core.drafter`), next to the helpers every stage shares
(atomic writes, plots, config files, batching, the layer-id convention, target weights).
"""
