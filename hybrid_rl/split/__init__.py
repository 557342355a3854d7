"""Split placement (`trainer.placement=split`, issue 27): rollout ranks feed learner ranks, bounded staleness.

What is here (the Trainer dispatches by role through roles.py):
  staleness.py   versions, VersionedGroup, admission (`may_start`), StalenessRule (drop | correct),
                 LearnerQueue (bounded), staleness_metrics
  schedule.py    the protocol as an event simulation (`syncs_before` is the rollout loop's rule)
  transport.py   send_groups / recv_groups: finished groups as one packed int64 tensor, peer named on failure
  weight_sync.py send_weights (every learner rank) / receive_weights (rollout ranks), bucketed, inference dtype;
                 adapter-only with LoRA (AdapterTarget: update_adapter, or the native engine's own LoRA module)
  validation.py  which versions a fit() validates (validation_steps / validation_syncs), ResidentEngine
  inflight.py    trainer.inflight_update=continue: versions taken between decode steps (pair groups, sender
                 threads on learner rank 0, the store's offers; per-token versions from the engine's marks)
  groups.py      to_rollout_batch: received groups -> the RolloutBatch the colocated stages take
  placement.py   Layout (last R ranks generate) and check_placement (refusals naming the key)
  (the rate model and `python -m hybrid_rl.plan --from-run / --placement split`: plan/rates.py, plan/placement.py)

Who runs what (W ranks, R = trainer.rollout_ranks, k = trainer.max_staleness; Layout):
  ranks 0..W-R-1  learners: policy FSDP2-sharded over a mesh of the learner ranks only, optimizer resident,
                  no engine. Learner rank 0 receives, for step s, batch s-1's groups from every rollout rank
                  in rank order (recv_groups; deterministic order, so a k=0 run is reproducible), puts them in
                  the LearnerQueue, takes them under the StalenessRule at learner version s-1, and hands each
                  learner rank its share (scatter_object_from over the learner group). Every learner then runs
                  the colocated code unchanged: Trainer._score, the advantage stage, policy_update, on
                  to_rollout_batch(its groups). Then every learner calls send_weights(version s) (the gathers
                  are learner-group collectives; learner rank 0 broadcasts to the sync group).
  ranks W-R..W-1  rollout ranks: an engine (native with its own copy, or SGLang; vLLM is refused, placement.py), no
                  optimizer. Loop over batches b = 0, 1, ...: receive_weights for each version in
                  syncs_before(b, v, k) (and under trainer.inflight_update=continue each newer one between decode
                  steps: inflight.py); draw this
                  rank's prompts from its own PromptLoader(rank=r-(W-R), world_size=R); generate; rewards (rule
                  and reward model: see below) and dynamic-sampling filters here;
                  tag each group with the version (per token when partial rollouts swap mid-sequence);
                  send_groups to learner rank 0.
  The PhaseManager is not used on either side: nothing switches. Process groups every rank creates, in order:
  the learner mesh (DeviceMesh over the learner ranks), the learner and rollout pools' groups, the sync group
  [0] + rollout ranks (new_group), and with a reward model on R > 1 rollout ranks the rollout mesh (comm.py).

Reward model (reward.model_path): it lives on the rollout ranks, resident beside the engine, and the learners
never load it (roles.load_rollout_models). Why there: a group is complete on its rollout rank, and the
dynamic-sampling filter needs its rewards before the group is sent; on the learners the filter would have to
move after the queue, and the reward model would take memory the learners' training needs. The price: a
second model on every rollout rank, and its scoring (time/reward) on the pool that is the bottleneck where
split pays (long generations). Placement: with R > 1 FSDP2-sharded over a DeviceMesh of the rollout ranks
(1/R per rank, as colocated shards it over every rank; the rollout ranks already move in step, so its
collectives add no new waiting); with R = 1 one unsharded copy (no peer to shard with). It is loaded and
probed there before the engine is built, so the engine sizes its cache from what is left.

Staleness: batch b is generated with exactly version max(0, b - k) (staleness.py explains why not the
freshest): k = 0 alternates and is on-policy; queue capacity = groups per step x (k + 1). Under
trainer.inflight_update=continue (inflight.py) it starts with that version and takes every newer one the learners
make while it decodes (not one due for validation), tokens tagged with theirs: versions b - k .. b, fresher
and not reproducible.

Partial rollouts (rollout.partial, loop/partial.py; docs/partial_rollouts.md): each rollout rank keeps a pool of
carried samples and runs RolloutStage.run_partial, which stops a batch once its groups are done. The schedule then
runs one version closer (roles.schedule_k: batch b with version max(0, b - k + 1), k >= 1), so a group carried over
one batch is still at most k versions old at the learner, whose rule reads its oldest token; one carried longer is
dropped and counted. A rollout rank takes the next version where its batch stops, without draining the batch's long
samples, and continues them under that version, each new token tagged with it (VersionedGroup.token_versions).
Without rollout.partial a batch ends when its last sample does. Each
report carries the rank's pool; the learners keep the trained batch's (learner.CarriedSamples, in the run state), so
the checkpoint holds it and the start message gives each rollout rank its pool back.

Checkpoints: at a checkpoint after step s, samples in flight (queued groups of batches s .. s+k-1 and those
being generated) are dropped deterministically, not saved (with rollout.partial the samples carried as of batch
s - 1 are saved, above): the learner saves as today (policy, optimizer,
loader states, version s, and the reward normaliser (reward.normalize_model) as of batch s - 1: each batch's
report carries the rollout ranks' loader position and normaliser state, and the learners keep the ones of the
batch they train); on resume the rollout ranks start at batch s with version s weights (received by a first
sync from the loaded learner), their loaders and normaliser restored by the start message to batch s. At k = 0
nothing is in flight at a step boundary, so resume is bit-exact; at k > 0 the first k batches after a resume are
generated by version s instead of s-k+.., lag rising from 0 back to k (recorded by the lag metrics).

Metrics per step (names the wiring emits; rates.py reads some back): split/staleness_mean, split/staleness_max,
split/dropped, split/queue_depth, split/sync_s, split/sync_bytes, split/rollout_wait_s, split/learner_wait_s,
split/rollout_ranks, split/world_size; time/rollout and time/reward measured on the rollout ranks,
time/score, time/advantage, time/train on the learners (the max over ranks keeps each pool's own), and the
bottleneck line from rates.idle_fraction.

Signals: a SIGTERM / SIGINT on any rank stops the run after the learners' current step and checkpoint;
learner rank 0 then receives what the rollout ranks can still make and sends STOP where they wait for weights
(weight_sync.send_stop), so they end at once, not at their timeout (rollout_loop.py).

Validation (trainer.val_every, val_before_train; validation.py): the learners hold no engine, so the rollout
ranks run the colocated Validator on theirs, over the rollout pool, and validate version s, what colocated
validates after step s, as soon as they hold it (before batch s + k; a version no batch of the fit is made
with is sent for the validation alone). Learner rank 0 receives the metrics (tagged val/weights_version) and
the samples, and logs them at step s; the learners wait for them, so at k > 0 a validation stalls the overlap.

LoRA (model.lora.*): the learners train the adapters as colocated does; each rollout rank loads the frozen base
from model.path and injects the same adapters (roles.load_rollout_models), and every sync, the first one at
batch 0 included (the adapters' initial draw is learner rank 0's), sends the adapters only (weight_sync.py).
The native engine is the one tested here; vLLM and SGLang take the adapter through update_adapter, untested in
this placement.
"""
