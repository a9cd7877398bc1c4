"""Serving a trained run: its assets' schema (:mod:`.assets`, written by training, read here) and the model that
:func:`sparsejax.load` returns (:mod:`.model`)."""
