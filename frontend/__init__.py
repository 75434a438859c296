"""The tokenizer frontend process, the engine launcher, the offline `LLM` API and the ZMQ client."""
