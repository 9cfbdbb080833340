"""The OpenAI-compatible server: an API process in front of an engine-core process."""
