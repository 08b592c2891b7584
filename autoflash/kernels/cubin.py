"""What a cubin tells the driver about a kernel's parameters: the `.nv.info.<kernel>` section's
EIATTR_KPARAM_INFO records (ordinal, offset and size of each parameter, as `cuobjdump -elf` prints
them) and EIATTR_CBANK_PARAM_SIZE (the bytes the driver copies into the parameter bank). Read from
the ELF directly, so the check needs no CUDA tool and no GPU: what the driver will read at launch is
compared with what the host packs (kernels/launch.py KernelParams)."""
from __future__ import annotations

import dataclasses
import struct

# .nv.info attribute records: a format byte, an attribute byte, then for EIFMT_SVAL a 16-bit size and
# that many bytes, for the other formats a 16-bit value.
EIFMT_SVAL = 0x04
EIATTR_KPARAM_INFO = 0x17
EIATTR_CBANK_PARAM_SIZE = 0x19


@dataclasses.dataclass(frozen=True)
class Param:
    ordinal: int  # the parameter's position in the kernel's signature
    offset: int  # bytes from the start of the parameter bank
    size: int  # bytes


@dataclasses.dataclass(frozen=True)
class ParamTable:
    params: tuple[Param, ...]  # by ordinal
    bank_bytes: int  # EIATTR_CBANK_PARAM_SIZE

    @property
    def relative(self) -> tuple[tuple[int, int], ...]:
        """(offset, size) of each parameter from the first one's offset: sm_90 kernels whose first
        parameter is 64-byte aligned (a TMA map) start it past a pad that keeps the bank address
        aligned; the layout after it is the C ABI's, as a packed host buffer's."""
        base = self.params[0].offset if self.params else 0
        return tuple((p.offset - base, p.size) for p in self.params)


def _sections(elf: bytes) -> dict[str, bytes]:
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError(f"cubin: got {elf[:5]!r}..., expected a 64-bit ELF")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    strtab = headers[names][4]

    def name(offset: int) -> str:
        start = strtab + offset
        return elf[start:elf.index(b"\0", start)].decode()

    return {name(h[0]): elf[h[4]:h[4] + h[5]] for h in headers}


def param_table(cubin: bytes, kernel: str) -> ParamTable:
    """The parameter table of entry `kernel` in `cubin`; ValueError when the cubin has no such kernel."""
    info = _sections(cubin).get(f".nv.info.{kernel}")
    if info is None:
        raise ValueError(f"cubin: no .nv.info section for kernel {kernel!r}")
    params, bank, i = [], None, 0
    while i + 4 <= len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == EIFMT_SVAL:
            size, = struct.unpack_from("<H", info, i + 2)
            value, i = info[i + 4:i + 4 + size], i + 4 + size
        else:
            value, i = struct.unpack_from("<H", info, i + 2)[0], i + 4
        if attr == EIATTR_KPARAM_INFO:
            _index, ordinal, offset, flags = struct.unpack("<IHHI", value)
            params.append(Param(ordinal, offset, flags >> 18))  # size: the word's top 14 bits
        elif attr == EIATTR_CBANK_PARAM_SIZE:
            bank = value
    if bank is None:
        raise ValueError(f"cubin: kernel {kernel!r} has no EIATTR_CBANK_PARAM_SIZE")
    return ParamTable(tuple(sorted(params, key=lambda p: p.ordinal)), bank)
