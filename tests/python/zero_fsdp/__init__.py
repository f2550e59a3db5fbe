"""Fixture generator helpers for DeepSpeed ZeRO and FSDP/OLMo sharded checkpoints (see README.md)."""
