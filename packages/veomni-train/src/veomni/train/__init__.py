"""veomni.train."""
