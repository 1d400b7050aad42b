"""Write a checkpoint of refit-attn.layout's logical tensors, as a training job saves it.

    python refit-checkpoint.py /tmp/refit/checkpoint
"""

import sys
from pathlib import Path

import torch

import layoutlang
from layoutlang.io.torch_dtypes import torch_dtype
from layoutlang.io.weights import write_safetensors

folder = Path(sys.argv[1])
program = layoutlang.load(Path(__file__).parent / "refit-attn.layout")
generator = torch.Generator().manual_seed(0)
weights = {  # whole logical tensors, named as the program names them
    name: torch.randn(tensor.shape, generator=generator).to(torch_dtype(tensor.dtype))
    for name, tensor in program.tensors.items()
}
folder.mkdir(parents=True, exist_ok=True)
write_safetensors(folder / "model.safetensors", weights)
print(f"wrote {len(weights)} tensors to {folder / 'model.safetensors'}")
