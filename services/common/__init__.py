"""What the gateway, scheduler and workers share: bootstrap, telemetry, config, errors."""
