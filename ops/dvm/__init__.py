"""DVM fusion: clustering and splitting chains of vector ops into fused nodes."""
