"""Tokenize, Detokenize and GetTokenizerInfo: a generator's tokenizer, asked without generating (vLLM's
/tokenize, /detokenize and /tokenizer_info). The ids are those Generate would compute from: a prompt
tokenized as call_codec tokenizes it, a conversation rendered through the model's chat template.
Pure: no gRPC."""

from __future__ import annotations

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.generate_input import check_input
from services.scheduler.attach_types import ModelKey
from services.scheduler.call_codec import chat_rendering, chat_turn, known_token_ids, template_tool
from services.scheduler.model_text import BYTE_CHAT_TEMPLATE, ModelText
from services.scheduler.tokenizer import Tokenizer
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec

# The class transformers rebuilds an HF model's tokenizer with from its tokenizer.json (the tokenizers
# library runs that file here too); byte models have no file, so their name is ours.
HF_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
BYTE_TOKENIZER_CLASS = "ByteTokenizer"


def tokenize(request: gateway_pb2.TokenizeRequest, key: ModelKey, text: ModelText,
             max_seq_len: int) -> gateway_pb2.TokenizeResponse:
    check_input(request.prompt, request.messages, request.tools)
    rendering = chat_rendering(request)
    if request.prompt:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = text.tokenizer.encode(request.prompt, add_special_tokens=add_special)
    else:
        ids = text.chat_prompt_ids([chat_turn(m) for m in request.messages], [template_tool(t) for t in request.tools],
                                   rendering)
    token_bytes = text.tokenizer.token_bytes
    return gateway_pb2.TokenizeResponse(model=common_pb2.ModelRef(name=key.name, version=key.version),
                                        token_ids=ids, token_bytes=[token_bytes(i) for i in ids],
                                        max_seq_len=max_seq_len)


def detokenize(request: gateway_pb2.DetokenizeRequest, key: ModelKey,
               tokenizer: Tokenizer) -> gateway_pb2.DetokenizeResponse:
    ids = known_token_ids(request.token_ids, tokenizer.vocab_size, "token_ids")
    spelled = b"".join(tokenizer.token_bytes(i) for i in ids)
    return gateway_pb2.DetokenizeResponse(model=common_pb2.ModelRef(name=key.name, version=key.version),
                                          text=spelled.decode("utf-8", errors="replace"))


def tokenizer_info(key: ModelKey, spec: TokenizerSpec, max_seq_len: int) -> gateway_pb2.GetTokenizerInfoResponse:
    """What the workers declared of tokenizer_config.json, and the chat template chat renders."""
    is_hf = spec.kind is TokenizerKind.HF
    reply = gateway_pb2.GetTokenizerInfoResponse(
        model=common_pb2.ModelRef(name=key.name, version=key.version),
        tokenizer_class=HF_TOKENIZER_CLASS if is_hf else BYTE_TOKENIZER_CLASS,
        special_tokens=dict(spec.special_tokens),
        chat_template=spec.chat_template or ("" if is_hf else BYTE_CHAT_TEMPLATE), max_seq_len=max_seq_len)
    if spec.add_bos_token is not None:
        reply.add_bos_token = spec.add_bos_token
    if spec.add_eos_token is not None:
        reply.add_eos_token = spec.add_eos_token
    return reply
