"""Checkpoints as single files, and what every checkpoint shares: the tree codec and plain values,
the raw I/O, a directory's steps, discovery, retention, the claim. Every rank
writes and reads them on the node side; the login side reads headers and steps (`hpcdist ckpt`)."""
