"""The distributed runtime: P processes as one ``jax.distributed`` job and the model's output layer sharded over them.

:mod:`.launch` starts P local processes as one job (``sparsejax-launch``; :mod:`.supervisor` watches their output
and exits, :mod:`.ranks` holds each one's process and reads why it failed), :mod:`.process_group` joins a process to
the group (start-up faults named by rank), :mod:`.sharding` holds the mesh, the partition specs and the
``shard_map`` wiring of the model core's functions (``make_run`` -> ``Run``, one process or several).

This package imports the model core only (:mod:`.launch` also the run directories and flagfiles it needs to name a
training command's work directory), never the training application.
"""
