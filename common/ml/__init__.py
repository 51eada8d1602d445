"""The learning: algorithm declarations (algorithms), client objectives (objectives), the split
model (split_model), losses (losses) and evaluation (evaluation)."""
