"""sparsejax: LSH-sampled sparse training of huge output layers in JAX."""
