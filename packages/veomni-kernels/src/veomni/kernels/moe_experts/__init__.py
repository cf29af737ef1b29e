"""MoE expert computation over tokens grouped by expert. Grouped-GEMM kernels arrive with their own issue."""
