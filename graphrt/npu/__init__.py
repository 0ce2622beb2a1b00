"""The Ascend NPU path: TorchAir as graphrt's inner backend, and what runs of it without an NPU."""
