"""Runs the stock `openai` package against the gateway for tests/integration/test_openai_embeddings.py
(with .venv-openai's python: the package is not a project dependency); prints what its types parsed, as JSON.

argv: base_url, CA file, model name, cases as JSON ({"single": text, "batch": [texts], "dimensions": int}).
"""

from __future__ import annotations

import json
import ssl
import sys

import openai


def main() -> None:
    base_url, ca_path, model, cases = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60,
                           http_client=openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=ca_path)))
    seen: dict = {}
    # The client asks for base64 unless told otherwise, and decodes it itself.
    single = client.embeddings.create(model=model, input=cases["single"])
    seen["single"] = {"vectors": [d.embedding for d in single.data], "indexes": [d.index for d in single.data],
                      "objects": [d.object for d in single.data], "model": single.model,
                      "usage": single.usage.model_dump()}
    batch = client.embeddings.create(model=model, input=cases["batch"], encoding_format="float")
    seen["batch"] = {"vectors": [d.embedding for d in batch.data], "indexes": [d.index for d in batch.data],
                     "usage": batch.usage.model_dump()}
    short = client.embeddings.create(model=model, input=cases["single"], dimensions=cases["dimensions"])
    seen["short"] = short.data[0].embedding
    try:
        client.embeddings.create(model=model, input=[])
        seen["empty"] = None
    except openai.BadRequestError as exc:
        seen["empty"] = {"status": exc.status_code, "param": exc.body.get("param") if isinstance(exc.body, dict) else None}
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
