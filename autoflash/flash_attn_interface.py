"""FlashAttention-3's Python API on autoflash's kernels, where FA3 users import it from:
`from autoflash.flash_attn_interface import flash_attn_func` in place of
`from flash_attn_interface import flash_attn_func` (autoflash/dispatch/fa3_api.py says what runs).
Importing it also registers FA3's ops, torch.ops.flash_attn_3.fwd / bwd / fwd_combine /
get_scheduler_metadata with FA3's schemas, on autoflash (dispatch/fa3_ops.py), unless FA3's own
library has them."""
from autoflash.dispatch import fa3_ops
from autoflash.dispatch.fa3_api import (flash_attn_combine, flash_attn_func, flash_attn_qkvpacked_func,  # noqa: F401
                                        flash_attn_varlen_func, flash_attn_with_kvcache, get_scheduler_metadata)

fa3_ops.register()

__all__ = ["flash_attn_combine", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache", "get_scheduler_metadata"]
