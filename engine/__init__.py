"""One LLM engine: everything a prefill or a decode replica embeds."""
