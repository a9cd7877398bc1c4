"""A run's work directory as files: its checkpoints (:mod:`.checkpoint`, checksummed) and the seals that tie its
best state and assets to the run (:mod:`.seals`). Training writes them; serving and a resumed run read them."""
