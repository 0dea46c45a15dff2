"""The model repository: what a version directory holds, how it is checked, and how it is loaded.

    errors.py           the domain errors (a worker exits 2 on any of them)
    json_fields.py      strict reading of one JSON object; messages name the file and the field's path
    manifest.py         Manifest, ModelKind, and KINDS: each kind's block, keyed by the kind string
    envelope.py         the capacity declared at attach
    pinned_file.py      a file of the version directory and its sha256
    weights_spec.py     the weights files and their sha256; WEIGHTS_FORMATS keyed by `weights.format`
    classifier_spec.py  the classifier block
    generator_spec.py   the generator block; ARCHITECTURES keyed by `architecture.format`
    hf_architecture.py  a Hugging Face checkpoint's architecture: its config.json
    tokenizer_spec.py   the generator's tokenizer; TOKENIZERS keyed by `tokenizer.kind`
    tensor_spec.py      the tensor block: a TorchScript or ONNX file, its inputs, outputs and golden cases
    store.py            the layout on disk: list, find, read and write manifests, sha256 of files
    loader.py           sha256 check, weights, and the serving runtime each kind builds
    golden.py           the fixed inputs through the serving path, at load
    hf_import.py        a Hugging Face checkpoint directory -> a repository version (`infermesh models import`)
"""
