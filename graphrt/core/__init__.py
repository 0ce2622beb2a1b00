"""Pure-Python bookkeeping (no torch): requests, the KV block manager, the scheduler, stops."""
