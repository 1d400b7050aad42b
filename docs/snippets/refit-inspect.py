"""Read back the per-rank files of `layoutlang apply --to` and compare them with the checkpoint.

    python refit-inspect.py /tmp/refit/checkpoint /tmp/refit/vllm
"""

import sys
from pathlib import Path

import torch

import layoutlang
from layoutlang.io.safetensors import read_safetensors_header
from layoutlang.io.weights import SafetensorsCheckpoint

checkpoint, out = SafetensorsCheckpoint(sys.argv[1]), Path(sys.argv[2])
vllm = layoutlang.load(Path(__file__).parent / "refit-attn.layout").layout("vllm")
for rank in vllm.mesh.ranks:
    path = out / f"rank{rank:05d}.safetensors"
    header, _ = read_safetensors_header(path)
    metadata = header.pop("__metadata__")
    # Every box the rank holds, read at its place in its storage, equals the checkpoint's region.
    stored = SafetensorsCheckpoint(path)
    equal = total = 0
    for name, tensor in vllm.tensors.items():
        for box in vllm.boxes(name, rank):
            shape = vllm.storage_shape(box.storage, rank)
            got = stored.read_box(box.storage, tensor.dtype, shape, box.storage_offsets, box.sizes)
            want = checkpoint.read_box(name, tensor.dtype, tensor.shape, box.offsets, box.sizes)
            equal, total = equal + torch.equal(got, want), total + 1
    print(
        f"{path.name} (layout {metadata['layout']}, rank {metadata['rank']}, "
        f"plan {metadata['plan'][:16]}): {equal} of {total} boxes equal to the checkpoint"
    )
print(f"storages in {path.name}, as the engine holds them:")
for storage, entry in header.items():
    print(f"  {storage:30}  {entry['dtype']}  {entry['shape']}")
