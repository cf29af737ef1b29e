"""Wan2.1 (diffusers' ``WanTransformer3DModel``): veomni's kernels and Ulysses SP bound to it, its pipeline
directory, its frozen condition models, and its family declaration (`veomni.models.wan.family`)."""
