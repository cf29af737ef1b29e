"""GLM-4.5-style MoE adapter (``model_type`` ``glm4_moe``): the patch config, its generated modeling file and the
family's training helpers."""
