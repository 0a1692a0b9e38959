"""Token data for training: a byte-level tokenizer, ``prepare`` (text -> tokens.h5), and the
dataset and distributed sampler the trainer reads it with."""
