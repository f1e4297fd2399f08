"""Model code apart from serving: architectures (runner), the ragged attention batch, packed and
quantised linears, GGUF files and their conversion. Kernels live in specdec.native."""
