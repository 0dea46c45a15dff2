"""The gateway's costs: CPU per admitted and refused request, TLS, quotas across gateways, shadow traffic,
the OpenAI front against gRPC, unary calls against the Submit stream, and scheduler failover as clients see it."""
