"""python -m services.gateway [--flags]; see services/gateway/config.py."""

from services.common.config import load_config
from services.common.server import freeze_long_lived, run
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService


def _load():
    config = load_config(GatewayConfig, "gateway")
    service = GatewayService(config)
    freeze_long_lived()  # start-up made what lives as long as the process; a full collection pauses every stream
    return config, service


if __name__ == "__main__":
    run("gateway", _load)
