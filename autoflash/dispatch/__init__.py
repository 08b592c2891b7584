"""What models call: the SDPA drop-in autoflash.attention (sdpa.py), its torch.library custom ops
(ops.py), config selection from tuned tables and heuristics (selection.py) and explain(). The
transformers integration is autoflash/hf.py (`import autoflash.hf`, its documented entry)."""
