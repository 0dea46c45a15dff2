"""What the stock-client scripts beside this file (openai_*_script.py, run with .venv-openai's python)
share: the 400 a call raised, as the `openai` package parsed it. Imported by its bare name: a script's
own folder is first on sys.path."""

from __future__ import annotations

import openai


def refusal(call) -> dict:
    """The 400 a call raised, as the client parsed it."""
    try:
        call()
    except openai.BadRequestError as err:
        error = err.body if isinstance(err.body, dict) else {}
        error = error.get("error", error)  # the error object, whether or not the client unwrapped it
        return {"status": err.status_code, "param": error.get("param"), "message": error.get("message")}
    return {"status": 200}
