"""Models shared by the training and inference jobs."""
