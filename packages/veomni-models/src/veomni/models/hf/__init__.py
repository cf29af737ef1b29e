"""Glue between transformers and veomni: attention entries, masks, experts, pretrained-model hooks, kernel binding."""
