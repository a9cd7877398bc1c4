"""A run's work directory as files: its checkpoints (:mod:`.checkpoint`, checksummed), its best state
(:mod:`.best_checkpoint`) and the seals that tie that state and its assets to the run (:mod:`.seals`), both read back
into the running code's state layout (:mod:`.saved_state`) with orbax's logs kept quiet (:mod:`.orbax_logs`).
Training writes them; serving and a resumed run read them."""
