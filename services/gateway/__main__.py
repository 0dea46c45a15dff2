"""python -m services.gateway [--flags]; see services/gateway/config.py."""

from services.common.config import load_config
from services.common.server import run
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService


def _load():
    config = load_config(GatewayConfig, "gateway")
    return config, GatewayService(config)


if __name__ == "__main__":
    run("gateway", _load)
