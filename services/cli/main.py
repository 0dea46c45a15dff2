"""`infermesh`: what every service has in force, and classify / generate through the gateway.

    infermesh status [--gateway ADDR] [--scheduler ADDR ...] [--worker ADDR ...] [--json]
    infermesh classify FILE --model M          (PNG/JPEG bytes, or a uint8 .npy array HxW or HxWxC)
    infermesh generate PROMPT --model M [--max-tokens N] [--stream]
    infermesh rollout pause|resume|abort|promote MODEL [--gateway ADDR] [--json]
                                               (at the decider gateway; Admin/ControlRollout)
    infermesh models import FILE --name N --version V [--repository DIR] [--input NAME:DATATYPE:DIMS ...]
                                               (a TorchScript or ONNX file as a tensor model version)
    infermesh completion bash|zsh              (eval "$(infermesh completion bash)")

Exit codes: 0 ok; 1 an RPC failed (for status: any target); 2 usage (bad flags, unreadable file).
TLS: with --ca-file the channels verify the server against it (server TLS at the gateway, mTLS
at schedulers and workers with --cert-file/--key-file, an operator identity); without it, plaintext.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from infermesh.v1 import admin_pb2, admin_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cli import completion, models
from services.cli.errors import UsageError
from services.cli.render import Answer, render_json, render_text
from services.common import admin_servicer, build_info, client_files

DEFAULT_GATEWAY = "127.0.0.1:50051"
API_KEY_ENV = "INFERMESH_API_KEY"
_FINISH = {v.number: v.name.removeprefix("FINISH_REASON_").lower()
           for v in common_pb2.FinishReason.DESCRIPTOR.values}


# --------------------------------------------------------------------------- arguments


def _common(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument("--api-key", default=None,
                       help=f"gateway API key (else --api-key-file, else ${API_KEY_ENV})")
    group.add_argument("--api-key-file", default=None, help="file holding the gateway API key")
    group.add_argument("--ca-file", default=os.environ.get("INFERMESH_CA_FILE", ""),
                       help="PEM CA bundle that verifies the servers; empty: plaintext (default: $INFERMESH_CA_FILE)")
    group.add_argument("--cert-file", default=os.environ.get("INFERMESH_CERT_FILE", ""),
                       help="PEM client certificate for mTLS ports (an operator identity for status)")
    group.add_argument("--key-file", default=os.environ.get("INFERMESH_KEY_FILE", ""),
                       help="PEM private key of --cert-file")
    group.add_argument("--timeout", type=float, default=10.0, help="seconds per RPC (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infermesh", description="Operate an infermesh mesh.")
    parser.add_argument("--version", action="version", version=f"infermesh {build_info.VERSION}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    status = commands.add_parser("status", help="what each service has in force (Admin/GetStatus)")
    status.add_argument("--gateway", default=os.environ.get("INFERMESH_GATEWAY", DEFAULT_GATEWAY),
                        help="gateway address; empty to skip (default: $INFERMESH_GATEWAY or %(default)s)")
    status.add_argument("--scheduler", action="append", default=[], metavar="ADDR",
                        help="a scheduler's address (repeat for several)")
    status.add_argument("--worker", action="append", default=[], metavar="ADDR",
                        help="a worker's address (repeat for several)")
    status.add_argument("--json", action="store_true", help="JSON for machines instead of tables")
    _common(status)

    classify = commands.add_parser("classify", help="classify an image through the gateway")
    classify.add_argument("file", help="PNG or JPEG file, or a uint8 .npy array (HxW or HxWxC)")
    classify.add_argument("--model", required=True)
    classify.add_argument("--model-version", default="", help="a version; empty: the routing's choice")
    classify.add_argument("--top-k", type=int, default=1,
                          help="labels to print, 1..the model's class count (default: %(default)s)")
    classify.add_argument("--gateway", default=os.environ.get("INFERMESH_GATEWAY", DEFAULT_GATEWAY))
    classify.add_argument("--json", action="store_true")
    _common(classify)

    generate = commands.add_parser("generate", help="generate text through the gateway")
    generate.add_argument("prompt")
    generate.add_argument("--model", required=True)
    generate.add_argument("--model-version", default="")
    generate.add_argument("--max-tokens", type=int, default=0, help="0: the model's default")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stream", action="store_true", help="print tokens as they come")
    generate.add_argument("--gateway", default=os.environ.get("INFERMESH_GATEWAY", DEFAULT_GATEWAY))
    generate.add_argument("--json", action="store_true",
                          help="one JSON object at the end (with --stream: one JSON line per chunk)")
    _common(generate)

    rollout = commands.add_parser("rollout", help="pause, resume, abort or promote a model's rollout by hand "
                                                  "(at the decider gateway)")
    rollout.add_argument("action", choices=tuple(admin_servicer.ACTION_BY_NAME),
                         help="pause: hold the share; resume: back to the automatic path; abort: share 0; "
                              "promote: share 100")
    rollout.add_argument("model")
    rollout.add_argument("--gateway", default=os.environ.get("INFERMESH_GATEWAY", DEFAULT_GATEWAY),
                         help="the decider gateway's address (default: $INFERMESH_GATEWAY or %(default)s)")
    rollout.add_argument("--json", action="store_true")
    _common(rollout)

    models.add_parser(commands)

    shell = commands.add_parser("completion", help="print a shell completion script")
    shell.add_argument("shell", choices=completion.SHELLS)
    return parser


# --------------------------------------------------------------------------- connections


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def channel(address: str, args: argparse.Namespace) -> grpc.Channel:
    if bool(args.cert_file) != bool(args.key_file):
        raise UsageError("--cert-file and --key-file go together")
    if not args.ca_file and args.cert_file:
        raise UsageError("--cert-file needs --ca-file (a client certificate is only sent over TLS)")
    try:
        credentials = client_files.credentials_from_files(args.ca_file, args.cert_file, args.key_file)
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror or exc}") from None
    return client_files.open_channel(address, credentials)


def api_key(args: argparse.Namespace) -> str:
    """--api-key, else --api-key-file, else $INFERMESH_API_KEY; "" when none (anonymous gateways)."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        return _read(args.api_key_file, "API key file").decode("utf-8", "replace").strip()
    return os.environ.get(API_KEY_ENV, "")


def metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    key = api_key(args)
    return (("authorization", f"Bearer {key}"),) if key else ()


def _rpc_error(exc: grpc.RpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


# --------------------------------------------------------------------------- commands


def ask_status(address: str, args: argparse.Namespace, call_metadata) -> Answer:
    try:
        with channel(address, args) as ch:
            reply = admin_pb2_grpc.AdminStub(ch).GetStatus(admin_pb2.GetStatusRequest(), timeout=args.timeout,
                                                           metadata=call_metadata)
        return Answer(address, admin_servicer.from_proto(reply))
    except grpc.RpcError as exc:
        return Answer(address, error_code=exc.code().name, error_message=exc.details() or "")
    except ValueError as exc:
        return Answer(address, error_code="BAD_REPLY", error_message=str(exc))


def run_status(args: argparse.Namespace) -> int:
    if not (args.gateway or args.scheduler or args.worker):
        raise UsageError("nothing to ask: give --gateway, --scheduler or --worker")
    answers = []
    if args.gateway:
        answers.append(ask_status(args.gateway, args, metadata(args)))
    answers += [ask_status(address, args, ()) for address in (*args.scheduler, *args.worker)]
    print(render_json(answers) if args.json else render_text(answers))
    return 0 if all(a.report is not None for a in answers) else 1


def image_of(path: str) -> common_pb2.Image:
    if path.endswith(".npy"):
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read {path} as a .npy array: {exc}") from None
        if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
            raise UsageError(f"{path}: need a uint8 array HxW or HxWxC (C = 1, 3 or 4), got {array.dtype} "
                             f"{array.shape}")
        channels = 1 if array.ndim == 2 else array.shape[2]
        return common_pb2.Image(raw=common_pb2.RawImage(pixels=array.tobytes(), height=array.shape[0],
                                                        width=array.shape[1], channels=channels))
    return common_pb2.Image(encoded=_read(path, "image"))


def run_classify(args: argparse.Namespace) -> int:
    request = gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=args.model, version=args.model_version),
                                          image=image_of(args.file), top_k=args.top_k)
    with channel(args.gateway, args) as ch:
        reply = gateway_pb2_grpc.InferenceStub(ch).Classify(request, timeout=args.timeout, metadata=metadata(args))
    labels = [{"label": x.label, "index": x.index, "score": round(x.score, 6)} for x in reply.labels]
    if args.json:
        print(json.dumps({"request_id": reply.request_id, "model": reply.model.name,
                          "version": reply.model.version, "labels": labels}))
    else:
        print(f"{reply.model.name}:{reply.model.version}")
        for x in labels:
            print(f"  {x['label']:<12} {x['score']:.4f}")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=args.model, version=args.model_version),
                                          prompt=args.prompt, sampling=sampling)
    text, last = [], None
    with channel(args.gateway, args) as ch:
        for chunk in gateway_pb2_grpc.InferenceStub(ch).Generate(request, timeout=args.timeout,
                                                                  metadata=metadata(args)):
            text.append(chunk.text)
            last = chunk
            if args.stream and args.json:
                print(json.dumps({"index": chunk.index, "text": chunk.text, "token_ids": list(chunk.token_ids),
                                  "finish_reason": _FINISH.get(chunk.finish_reason, "")}), flush=True)
            elif args.stream:
                print(chunk.text, end="", flush=True)
    usage = {"prompt_tokens": last.usage.prompt_tokens, "completion_tokens": last.usage.completion_tokens,
             "cached_prompt_tokens": last.usage.cached_prompt_tokens} if last else {}
    finish = _FINISH.get(last.finish_reason, "") if last else ""
    if args.json and not args.stream:
        print(json.dumps({"request_id": last.request_id if last else "", "text": "".join(text),
                          "finish_reason": finish, "usage": usage}))
    elif not args.json:
        if not args.stream:
            print("".join(text), end="")
        print()
        print(f"[{finish}; {usage.get('completion_tokens', 0)} tokens]", file=sys.stderr)
    return 0


def run_rollout(args: argparse.Namespace) -> int:
    request = admin_pb2.ControlRolloutRequest(model=args.model, action=admin_servicer.ACTION_BY_NAME[args.action])
    with channel(args.gateway, args) as ch:
        reply = admin_pb2_grpc.AdminStub(ch).ControlRollout(request, timeout=args.timeout, metadata=metadata(args))
    if args.json:
        print(json.dumps({"model": reply.model, "canary_version": reply.canary_version, "state": reply.state,
                          "step": reply.step, "canary_percent": reply.canary_percent, "decision": reply.decision}))
    else:
        print(f"{reply.model} canary {reply.canary_version}: {reply.state} at step {reply.step}, "
              f"canary share {reply.canary_percent:g}%")
        print(f"  {reply.decision or 'already ' + reply.state + ': nothing changed'}")
    return 0


_COMMANDS = {"status": run_status, "classify": run_classify, "generate": run_generate, "rollout": run_rollout,
             "models": models.run_models}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "completion":
        print(completion.script(parser, args.shell))
        return 0
    try:
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"infermesh {args.command}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"infermesh {args.command}: {_rpc_error(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
