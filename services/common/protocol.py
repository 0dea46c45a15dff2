"""Numbers two services must agree on, each kept once here."""

from __future__ import annotations

# The Attach protocol (protos/infermesh/v1/scheduler.proto) a worker speaks in its hello and the
# newest one a scheduler serves. 2: TOKENIZER_KIND_HF, whose tokenizer.json follows the hello in
# tokenizer_file messages. Schedulers roll before workers: an older scheduler refuses a newer hello.
ATTACH_PROTOCOL_VERSION = 2
# The first version whose hello may declare TOKENIZER_KIND_HF (older schedulers would have served
# it with the byte tokenizer, so such a worker must be refused by them).
HF_TOKENIZER_PROTOCOL_VERSION = 2
# tokenizer.json travels in pieces of at most this many bytes (gRPC's default message limit is 4 MiB),
# and is at most MAX_TOKENIZER_FILE_BYTES in all (the scheduler holds it while it builds).
TOKENIZER_FILE_CHUNK_BYTES = 1024 * 1024
MAX_TOKENIZER_FILE_BYTES = 128 * 1024 * 1024

# Generated tokens a request gets when it names no max_tokens: the scheduler generates up to this
# (capped by the model's max sequence length), and the gateway charges the tenant's token quota for
# it up front (refunding what was not generated).
DEFAULT_MAX_TOKENS = 128
