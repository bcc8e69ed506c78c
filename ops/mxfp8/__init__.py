"""MXFP8 (OCP Microscaling, E4M3 data, E8M0 scales): quantisation and quantised matmul ops."""
