"""layoutlang inside other systems: inference engines and training frameworks.

- :mod:`layoutlang.integrations.dtensor`: the training side of a refit read from a
  ``state_dict`` of DTensors (FSDP2, TP, EP): the layout it implies, and the check that a
  layout matches it.
- :mod:`layoutlang.integrations.vllm`: layoutlang as a vLLM weight-transfer engine
  (``weight_transfer_config={"backend": "layoutlang"}``), trainer side and worker side.
- :mod:`layoutlang.integrations.ray`: ranks of a refit as Ray actors, found through a named
  rendezvous actor (``layoutlang apply --ray`` runs on it).
- :mod:`layoutlang.integrations.workers`: what every worker pool shares (the local
  launcher's and Ray's): its errors, task reports and signed default group.
"""
