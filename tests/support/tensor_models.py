"""Small models made in the tests, exported to TorchScript and to ONNX, for the `tensor` kind.

    cnn:  x FP32 [-1, 1, 8, 8]                 -> probs FP32 [-1, 10]   (softmax: a score vector)
    mlp:  a FP32 [-1, 4], b FP32 [-1, 3]        -> y FP32 [-1, 5], norm FP32 [-1, 1]
    seq:  tokens INT64 [-1, -1] (a sequence)    -> pooled FP32 [-1, 8], logits FP32 [-1, -1, 5]

Weights come from a fixed seed, so every export of one model is the same network. ONNX goes
through torch.onnx.export's TorchScript-based exporter (dynamo=False), which needs no onnxscript.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.worker.repository.tensor_import import ImportRequest, import_tensor_model, parse_input_flag


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return torch.softmax(self.head(h.flatten(1)), dim=-1)


class TwoInputMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 6)
        self.out = nn.Linear(6, 5)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.out(torch.tanh(self.a(a) + self.b(b)))
        return y, y.norm(dim=-1, keepdim=True)


class SeqModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(tokens)
        return h.mean(dim=1), self.proj(h)


@dataclass(frozen=True)
class ExportedModel:
    name: str
    module: type[nn.Module]
    inputs: tuple[str, ...]  # --input flags (TorchScript needs them; ONNX reads the graph)
    outputs: tuple[str, ...]
    dynamic: dict[str, dict[int, str]]  # ONNX dynamic axes, inputs and outputs

    def example(self) -> tuple[torch.Tensor, ...]:
        shapes = [parse_input_flag(flag) for flag in self.inputs]
        return tuple(
            torch.randint(0, 16, [2 if d == -1 else d for d in io.dims]) if io.datatype == "INT64"
            else torch.randn([2 if d == -1 else d for d in io.dims]) for io in shapes)


CNN = ExportedModel("cnn", SmallCnn, ("x:FP32:-1,1,8,8",), ("probs",), {"x": {0: "batch"}, "probs": {0: "batch"}})
MLP = ExportedModel("mlp", TwoInputMlp, ("a:FP32:-1,4", "b:FP32:-1,3"), ("y", "norm"),
                {"a": {0: "batch"}, "b": {0: "batch"}, "y": {0: "batch"}, "norm": {0: "batch"}})
SEQ = ExportedModel("seq", SeqModel, ("tokens:INT64:-1,-1",), ("pooled", "logits"),
                {"tokens": {0: "batch", 1: "seq"}, "pooled": {0: "batch"}, "logits": {0: "batch", 1: "seq"}})
MODELS = (CNN, MLP, SEQ)


def build(model: ExportedModel) -> nn.Module:
    torch.manual_seed(1234)
    return model.module().eval()


def export_torchscript(model: ExportedModel, directory: Path) -> Path:
    path = directory / f"{model.name}.pt"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates TorchScript; users still bring it
        torch.jit.trace(build(model), model.example()).save(str(path))
    return path


def export_onnx(model: ExportedModel, directory: Path) -> Path:
    path = directory / f"{model.name}.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript-based exporter's deprecation notice
        torch.onnx.export(build(model), model.example(), str(path), dynamo=False,
                          input_names=[flag.split(":")[0] for flag in model.inputs],
                          output_names=list(model.outputs), dynamic_axes=model.dynamic)
    return path


def onnx_with_op(path: Path, op: str, domain: str = "") -> None:
    """A one-node ONNX graph x FP32 [batch, 4] -> y running `op` (from `domain`), built by hand."""
    from onnx import TensorProto, helper, save

    node = helper.make_node(op, ["x"], ["y"], domain=domain)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    save(model, str(path))


def install_unloadable(repository: Path, name: str, template: Path, op: str, domain: str = "") -> None:
    """`repository/name/1`: a manifest like `template`'s (a valid tensor manifest) over a graph with `op`."""
    import hashlib
    import json

    directory = repository / name / "1"
    directory.mkdir(parents=True)
    onnx_with_op(directory / "bad.onnx", op, domain)
    manifest = json.loads(template.read_text())
    manifest.update(name=name, version="1")
    manifest["weights"] = {"file": "bad.onnx",
                           "sha256": hashlib.sha256((directory / "bad.onnx").read_bytes()).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def import_model(model: ExportedModel, fmt: str, directory: Path, repository: Path, *, version: str = "1",
                 max_batch_size: int = 8, name: str | None = None) -> Path:
    """Exports `model` as `fmt` into `directory` and imports it into `repository` as `<name>/<version>`."""
    source = export_torchscript(model, directory) if fmt == "torchscript" else export_onnx(model, directory)
    flags = model.inputs if fmt == "torchscript" else ()
    return import_tensor_model(ImportRequest(
        source=source, name=name or f"{model.name}-{fmt}", version=version, repository=repository,
        inputs=tuple(parse_input_flag(f) for f in flags),
        output_names=model.outputs if fmt == "torchscript" else (), max_batch_size=max_batch_size))
