"""Image input: a vision encoder run once per image, its embeddings merged into the token stream."""
