"""Sampling: turning logits into tokens, per request, in one batched pass."""
