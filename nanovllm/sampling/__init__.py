"""Sampling on rank 0: the plain draw (``sampler``, ``draw``, ``triton_draw`` on a GPU) and,
loaded only when a step needs them, filters, penalties, masks and log-probabilities (``extras``)."""
