"""``graphrt bench``: decode throughput side by side with transformers, start-up, roofline,
grammar overhead. Every comparison is measured interleaved in one process or one run."""
