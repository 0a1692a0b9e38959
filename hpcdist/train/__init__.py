"""Data-parallel training of the GPT model (node side: every rank runs it), with checkpoints that survive preemption.

``hpcdist.train.params`` (light: pydantic only) registers the ``train_gpt`` job kind; the
runner in ``hpcdist.train.loop`` runs on the nodes.
"""
