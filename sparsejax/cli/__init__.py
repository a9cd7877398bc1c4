"""The commands: ``sparsejax-train`` (:mod:`.train`), ``sparsejax-predict`` (:mod:`.predict`) and ``sparsejax-plot``
(:mod:`.plot`), on the command line that :mod:`.flags` makes of the settings.

The top layer, beside ``sparsejax.fit`` (:mod:`sparsejax.fitting`): it may import the training application, serving
and the network analysis; nothing below it imports it.
"""
