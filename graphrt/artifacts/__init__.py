"""The on-disk graph cache: entry keys, the manifest, SHA-256 checks and atomic writes."""
