"""KV transfer between engines: the connector contract and its transports."""
