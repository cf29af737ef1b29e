"""veomni.models."""
