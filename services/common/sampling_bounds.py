"""SamplingParams' bounds, one home for every service that checks them: the gateway's fronts refuse
past them with a 400 naming the field, the scheduler with INVALID_ARGUMENT, the worker again (a
scheduler of another version may send anything), and the importer checks a model's recommended
sampling against them."""

from __future__ import annotations

# Penalties: presence and frequency in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's), repetition in (0, MAX_PENALTY].
MAX_PENALTY = 2.0
# A logit_bias value's bound (OpenAI's) and how many entries logit_bias holds.
MAX_BIAS = 100.0
MAX_LOGIT_BIAS = 1024
# top_k's bound: past any vocabulary (a larger value keeps every token, as vLLM reads it).
MAX_TOP_K = 1_000_000
MAX_STOP_TOKEN_IDS = 64
# allowed_token_ids travels with every sampling step to the worker, so it is bounded (vLLM bounds it
# only by the vocabulary): 4096 ids are 8-12 KiB a step; a list that keeps nearly every token is better
# said with bad_words or logit_bias.
MAX_ALLOWED_TOKEN_IDS = 4096
# bad_words: every sampling step checks each word against the output's end.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_BYTES = 256
