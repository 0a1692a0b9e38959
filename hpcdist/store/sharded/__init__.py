"""Sharded checkpoints: every rank writes its own part, one commit for all (DCP's planner and
storage layer, the layout and index, which rank writes each replicated value, DCP's own folder
format for `hpcdist ckpt`). Node side, every rank; the login side converts with `hpcdist ckpt`."""
