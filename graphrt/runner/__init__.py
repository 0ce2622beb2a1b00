"""The runner: graph keys and dispatch, step batches, input buffers, request slots, KV sizing,
the step module and the model runner."""
