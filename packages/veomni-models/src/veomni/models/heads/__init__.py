"""Task heads on any registered backbone: causal LM loss, sequence and token classification."""
