"""The load generator's own cost: CPU per request and per streamed token, and its lag, per target kind."""
