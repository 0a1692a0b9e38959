"""Token data for training (node side, and `hpcdist data prepare` on the login node): a byte-level
tokenizer, ``prepare`` (text -> tokens.h5), and the dataset and distributed sampler the trainer
reads it with."""
