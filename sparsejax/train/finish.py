"""How a run ends: a search's candidate with its best validation score; a run with the final evaluation of its
selected state on the whole test set (the centroid fusion chosen, the serving index saved), recorded and logged."""

from typing import Any

import jax
from absl import logging

from sparsejax import evaluation, memory, model
from sparsejax.train import model_selection, recipes

# Final-record fields that describe the run rather than a point of a curve.
SUMMARY_FIELDS = ("step", "epoch", "last_loss", "samples_per_sec", "seconds", "train_seconds", "budget_seconds",
                  "num_params", "final",
                  "num_processes", "last_step", "selected_step", "selected_by", "stopped_by", "bad_evaluations",
                  "improved_step", "stale_evaluations", "recipe", "search_seconds", "search_wall_seconds",
                  "search_scores", "fusion_weight", "fusion_validation",
                  "ranker_weight", "ranker_validation", "ranker_labels", "ranker_seconds", "validation_split",
                  "near_neighbours")


def candidate_result(loop, state, start_step: int) -> dict[str, Any]:
  """What ``loop`` (a :class:`sparsejax.train.loop.Loop` that has trained ``state``) gives a recipe search: its best
  validation score (the test set is left alone) and what the search plans from."""
  if loop.selection.last_step != loop.step:  # a candidate resumed at its budget: its state was evaluated
    loop.write(loop.selection.evaluate(loop.run, loop.evaluated(state), loop.step,
                                        loop.config.run.eval_samples))
  loop.selection.best.wait()  # sealed: the winner's best state is adopted and checked as the run's
  if loop.writer is not None:
    loop.writer.close()
  return {"score": loop.selection.best_value, "step": loop.step, "train_seconds": loop.train_seconds,
          "samples": (loop.step - start_step) * loop.config.optim.batch_size, "step_seconds": loop.step_seconds,
          "budget_seconds": loop.budget_seconds, "eval_seconds": loop.eval_seconds,
          "eval_compile_seconds": loop.eval_compile_seconds, "eval_scoring_seconds": loop.selection.scoring_seconds}


def _without_training_arrays(loop, state, trained):
  """``state`` (the selected one) without its optimizer states and parameter average, every other array of it and
  of ``trained`` (the state as training left it: with parameter averaging, its own parameters besides the averaged
  ones selected) deleted; the final checkpoint keeps them. The final evaluation, the serving index and the served
  model read the parameters and the index only. At 8·10^6 labels over 4 processes a process's Adam moments (2 GB)
  beside the serving index's build (3 GB of temporaries) did not fit the 24 GB machine."""
  loop.checkpoints.wait()  # (saved: not read by a save in the background any more)
  kept = model_selection.without_optimizer(state)
  keep = {id(a) for a in jax.tree.leaves(kept)}  # a restored state's average holds its parameters
  for array in jax.tree.leaves((state, trained)):
    if id(array) not in keep and isinstance(array, jax.Array) and not array.is_deleted():
      array.delete()
  # Given back to the system, not kept by the allocator for this process alone: the other processes of the machine
  # may need it (the 10^9-parameter run's final evaluation ran with 0.6 GB of the 24 GB free).
  memory.release_free_memory()
  return kept


def final_evaluation(loop, state, start_step: int, search_summary: dict | None = None) -> dict[str, Any]:
  """The final evaluation of ``loop`` (a :class:`sparsejax.train.loop.Loop` that has trained ``state``) on the whole
  test set, of the selected state, recorded and logged."""
  step, trained = loop.step, state
  if loop.selection is not None:
    if loop.selection.last_step != step:  # the last state competes too (the loop evaluated it, if it trained)
      loop.write(loop.selection.evaluate(loop.run, loop.evaluated(state), step,
                                          loop.config.run.eval_samples))
    if loop.selection.is_live(step):  # not a second copy of the state read back from disk
      loop.selection.best.wait()
      loop.selection.best.check(step, loop.selection.best.run_id)  # what is served from it: unchanged on disk
      state = loop.evaluated(state)
    else:
      state, step = loop.selection.restore_best(loop.run, state)  # saved as evaluated: averaged
    logging.info("selected the state of step %d (validation %s %.4f) of %d steps", step,
                 loop.selection.metric, loop.selection.best_value, loop.step)
  else:
    state = loop.evaluated(state)
  state = _without_training_arrays(loop, state, trained)
  del trained
  fused, fusion_record = None, {}
  if loop.fusion_terms is not None and loop.selection is not None:
    centroids, rankers = loop.fusion_terms()
    fused, fusion_record = loop.selection.evaluator.choose_fusion(
        loop.run.exact_predictor(), state, centroids, rankers, loop.selection.metric, loop.config.run.eval_samples)
    if loop.save_fusion is not None:
      loop.save_fusion(fused)
  final, served = evaluation.evaluate_state(loop.evaluator, loop.run, state, None, fused)
  if loop.run.serving_index is not None:  # a clustered index: served holds the one evaluation queried
    index = loop.run.serving_index(served)  # every process: sharded, the shards' indexes are gathered
    if loop.save_serving_index is not None:  # sparsejax.load's sampled prediction needs not build it again
      loop.save_serving_index(step, index)
  if loop.stopped_by == "early_stopping":
    final.update(bad_evaluations=loop.selection.bad_evaluations, improved_step=loop.selection.improved_step,
                 stale_evaluations=loop.selection.stale_evaluations)
  if loop.selection is not None:
    final.update({"selected_step": step, "selected_by": f"validation {loop.selection.metric}",
                  f"validation_{loop.selection.metric}": loop.selection.best_value})
  final.update({
      "step": step, "last_step": loop.step, "epoch": step / loop.steps_per_epoch,
      # The last step's training loss (null when this invocation trained none): not the selected step's.
      "last_loss": loop.last_loss,
      "stopped_by": loop.stopped_by,
      "samples_per_sec": (loop.step - start_step) * loop.config.optim.batch_size / max(loop.train_seconds, 1e-9),
      "seconds": loop.seconds_before + loop.train_seconds, "train_seconds": loop.train_seconds,
      # What --max_seconds counted: the training and its evaluations (the final test evaluation excluded).
      "budget_seconds": round(loop.budget_seconds, 2),
      "num_params": model.num_params(state), "final": True, "num_processes": loop.run.num_shards,
      # Where no search ran, config says auto: the record names what trained.
      "recipe": recipes.trained(loop.config), **(search_summary or {}), **fusion_record,
  })
  if loop.writer is not None:
    loop.writer.write(final, curves=[k for k in final if k not in SUMMARY_FIELDS])
    loop.writer.close()
  logging.info("final (%s step %d, test set): P@1 %.4f  P@3 %.4f  P@5 %.4f  (sampled P@1 %s)%s",
               "selected" if loop.selection is not None else "last", step, final["p@1"], final["p@3"],
               final["p@5"], f"{final['sampled_p@1']:.4f}" if "sampled_p@1" in final else "n/a",
               evaluation.retrieval_line(final))
  return final
