"""The attention core: the entry point, the call record, the engines."""
