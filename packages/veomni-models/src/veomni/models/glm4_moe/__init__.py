"""GLM-4.5-style MoE adapter (``model_type`` ``glm4_moe``): its declaration, patch config and generated modeling."""
