"""Models shared by the training and inference jobs (node side; `hpcdist model` reads them on the
login node)."""
