"""The stages Trainer.step calls, top to bottom, each built from the parts it uses (never the Trainer):

preflight.py        the checks that need the machine, the model directory or an engine
rollout_stage.py    ROLLOUT and REWARD: prompts x G samples through the engine, scored (reward_setup.py),
                    dynamic sampling's rounds (dynamic_sampling.py)
advantage_stage.py  ADVANTAGE: loss mask, KL penalty, advantages -> TrainBatch
update.py           SCORE's log-probs and TRAIN: epochs x mini-batches x micro-batches
validation.py       pass@1 / pass@k on held-out prompts
run_state.py        what changes between steps, and the checkpointer that saves it with the weights
lr_schedule.py      the learning-rate multiplier per optimizer step
"""
