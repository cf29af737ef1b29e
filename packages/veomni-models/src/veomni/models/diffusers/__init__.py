"""The diffusers plumbing every diffusion family shares: the veomni build of a diffusers model (meta, FSDP2,
streamed weights), its diffusers-format export, the flow-matching schedule, and the lookup of a family's
`veomni.models.family.DiffusionRules` by ``_class_name``."""
