"""Data-parallel training of the GPT model (node side: every rank runs it), with checkpoints that survive preemption.

``hpcdist.train.params`` (light: pydantic only) registers the ``train_gpt`` job kind; the
runner in ``hpcdist.train.loop`` runs on the nodes, its steps made fast by ``hpcdist.train.speed``
(compile, TF32, fused AdamW) and read back by ``hpcdist.train.step_log`` only when it logs; when it
saves and stops is decided by the one ``CheckpointManager`` (``hpcdist.api.checkpoints``) with
``hpcdist.train.checkpoint``'s policy and state.
"""
