"""python -m services.gateway [--flags]; see services/gateway/config.py."""

import gc

from services.common.config import load_config
from services.common.server import run
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService


def _load():
    config = load_config(GatewayConfig, "gateway")
    service = GatewayService(config)
    # What start-up made lives as long as the process: frozen out of the collector's generations, a full
    # collection (each pauses every stream through the gateway) no longer walks it, as the scheduler does.
    gc.collect()
    gc.freeze()
    return config, service


if __name__ == "__main__":
    run("gateway", _load)
