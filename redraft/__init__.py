"""redraft: retrain EAGLE-3 draft models on a serving target's own hidden states.

The ``redraft`` command (:mod:`redraft.cli`) is every stage's command line under one name.
"""
