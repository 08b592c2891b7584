"""What a kernel compiles to: the instruction mix of its main loop, read from SASS without a GPU.

nvdisasm (from the pip-installed toolkit) disassembles a cubin with line information; the text is
split into basic blocks, the control-flow graph's natural loops are found (a back edge whose target
dominates its source), and the instructions of the loops that hold tensor-core MMAs (HMMA) are
counted by class. Ratios per HMMA make kernels with different tiles comparable: LDSM per HMMA is the
shared-memory operand traffic, integer/address instructions per HMMA the loop's bookkeeping.

This is static analysis, a proxy: it counts instructions that may issue, not time. It cannot see
latency hiding, stalls, bank conflicts or memory bandwidth, and a loop's branches that do not run on
every iteration are counted as if they did.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import subprocess
from pathlib import Path

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+|\.L_\d+):")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_TARGET = re.compile(r"`\((\.L_x_\d+|\.L_\d+)\)")

# Classes in the order reports print them.
CLASSES = ("HMMA", "LDSM", "LDGSTS", "LDS", "STS", "LDG", "STG", "ATOM/RED", "MUFU", "FP", "int/addr",
           "MOV", "SHFL", "BAR", "LDL/STL", "uniform", "control", "other")
_FP = {"FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK", "FSET", "F2FP", "F2F", "HADD2", "HFMA2", "HMUL2"}
_INT = {"IMAD", "IADD3", "IADD", "LEA", "ISETP", "SEL", "SHF", "LOP3", "LOP", "IABS", "IMNMX", "PRMT", "POPC",
        "FLO", "BREV", "BMSK", "I2F", "F2I", "I2I", "PLOP3", "P2R", "R2P", "SGXT", "IDP", "IMUL", "ISCADD", "SHL",
        "SHR", "VIADD", "VIMNMX", "IMNMX3", "VIADDMNMX", "S2R", "CS2R", "LDC", "I2FP", "F2IP"}
_CONTROL = {"BRA", "BSSY", "BSYNC", "WARPSYNC", "EXIT", "RET", "CALL", "NOP", "YIELD", "BREAK", "JMP", "JMX",
            "BRX", "KILL", "NANOSLEEP", "ELECT", "VOTE", "VOTEU", "DEPBAR", "LDGDEPBAR", "BMOV"}


def classify(op: str, pred: str | None = None) -> str | None:
    """The report class of one SASS opcode; None for never-executed placeholders (@!PT)."""
    if pred == "@!PT":
        return None
    base = op.split(".")[0]
    if op.startswith("IMAD.MOV") or base == "MOV":
        return "MOV"
    if base in ("HMMA", "LDSM", "LDGSTS", "LDS", "STS", "LDG", "STG", "MUFU", "SHFL", "BAR"):
        return base
    if base in ("ATOM", "ATOMS", "ATOMG", "RED", "REDG", "REDS"):
        return "ATOM/RED"
    if base in ("LDL", "STL"):
        return "LDL/STL"
    if base in _FP:
        return "FP"
    if base in _INT:
        return "int/addr"
    if base in _CONTROL:
        return "control"
    if base.startswith("U") or base in ("R2UR", "S2UR"):
        return "uniform"
    return "other"


@dataclasses.dataclass(frozen=True)
class Insn:
    addr: int
    pred: str | None
    op: str
    text: str
    line: tuple[str, int] | None  # (file, line) from the line table, when the cubin has one
    target: int | None  # index of the branch target instruction


@dataclasses.dataclass(frozen=True)
class Loop:
    """One step loop that holds HMMAs: the static counts of its body, per class.

    A step loop is the innermost loop that holds all the HMMAs of the outermost loop it sits in:
    FlashAttention-2's backward wraps its per-query-step loop in an outer loop over key blocks
    (`for (n_block = blockIdx.x; ...; n_block += gridDim.x)`, one trip per block by default), whose
    prologue and dK/dV epilogue are per-block work, not per-step work."""

    header_addr: int
    counts: dict[str, int]
    lines: tuple[int, int] | None  # the range of source lines its instructions come from
    nested: bool  # holds an inner loop whose trip count static counts cannot know
    # global loads in one pass over the body, per thread: {"LDGSTS" | "LDG": (instructions, bytes)}
    global_loads: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    addr_range: tuple[int, int] | None = None  # first and last instruction address of the body
    # The outermost loop it was found in, when that is another loop: (header address, instructions).
    outer: tuple[int, int] | None = None
    # Counts of the blocks some iteration skips (they do not dominate every back edge): branches
    # taken at run time, which a whole-body count charges to every iteration.
    conditional: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def per_hmma(self, cls: str | None = None) -> float:
        h = self.counts.get("HMMA", 0)
        if not h:
            return float("nan")
        return (self.total if cls is None else self.counts.get(cls, 0)) / h


def parse(text: str) -> list[Insn]:
    """Instructions of one kernel's nvdisasm listing (run with -g for line information)."""
    insns: list[Insn] = []
    targets: list[str | None] = []  # branch labels, resolved once every label is known
    labels: dict[str, int] = {}
    line = None
    pending: list[str] = []
    for raw in text.splitlines():
        m = _LINE.search(raw)
        if m:
            line = (m.group(1).rsplit("/", 1)[-1], int(m.group(2)))
            continue
        m = _LABEL.match(raw)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.match(raw)
        if not m:
            continue
        body = m.group(2).strip()
        pred = None
        if body.startswith("@"):
            pred, body = body.split(None, 1)
        t = _TARGET.search(body)
        targets.append(t.group(1) if t else None)
        insns.append(Insn(int(m.group(1), 16), pred, body.split()[0], body, line, None))
        for lbl in pending:
            labels[lbl] = len(insns) - 1
        pending = []
    return [dataclasses.replace(i, target=labels.get(t)) if t else i for i, t in zip(insns, targets)]


def _is_jump(ins: Insn) -> bool:
    """ptxas leaves `#pragma unroll 1` loops through CALL.REL.NOINC to the label after the loop:
    a jump, not a call."""
    return ins.op.startswith("CALL.REL.NOINC")


def _blocks(insns: list[Insn]) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
    leaders = {0}
    for i, ins in enumerate(insns):
        base = ins.op.split(".")[0]
        if (base in ("BRA", "EXIT", "RET", "BRX", "JMX") or _is_jump(ins)) and i + 1 < len(insns):
            leaders.add(i + 1)
        if ins.target is not None:
            leaders.add(ins.target)
    starts = sorted(leaders)
    blocks = [(s, starts[k + 1] if k + 1 < len(starts) else len(insns)) for k, s in enumerate(starts)]
    index = {s: b for b, (s, _) in enumerate(blocks)}
    succ: dict[int, list[int]] = collections.defaultdict(list)
    for b, (s, e) in enumerate(blocks):
        last = insns[e - 1]
        base = last.op.split(".")[0]
        if (base == "BRA" or _is_jump(last)) and last.target is not None:
            succ[b].append(index[last.target])
            if last.pred is not None and b + 1 < len(blocks):
                succ[b].append(b + 1)
        elif base in ("EXIT", "RET") and last.pred is None:
            pass
        elif b + 1 < len(blocks):
            succ[b].append(b + 1)
    return blocks, succ


def _dominators(n: int, succ: dict[int, list[int]]) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Each block's dominators (block 0 is the entry) and its predecessors."""
    preds: dict[int, set[int]] = collections.defaultdict(set)
    for b, ss in succ.items():
        for x in ss:
            preds[x].add(b)
    everything = set(range(n))
    dom = {b: set(everything) for b in range(n)}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            ps = [dom[p] for p in preds[b]]
            new = (set.intersection(*ps) if ps else set()) | {b}
            if new != dom[b]:
                dom[b], changed = new, True
    return dom, preds


def _loop_bodies(n: int, succ: dict[int, list[int]]) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Natural loops by header (the blocks that reach a back edge b -> h, h dominating b, without
    passing through h), and the dominators they were found with."""
    dom, preds = _dominators(n, succ)
    loops: dict[int, set[int]] = {}
    for b, ss in succ.items():
        for h in ss:
            if h in dom[b]:  # back edge b -> h
                body, stack = {h, b}, ([b] if b != h else [])
                while stack:
                    for p in preds[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                loops.setdefault(h, set()).update(body)
    return loops, dom


def _natural_loops(n: int, succ: dict[int, list[int]]) -> list[set[int]]:
    return list(_loop_bodies(n, succ)[0].values())


def _counts(insns) -> collections.Counter:
    return collections.Counter(c for ins in insns if (c := classify(ins.op, ins.pred)) is not None)


def _step_loops(insns: list[Insn], blocks, bodies: dict[int, set[int]]) -> list[tuple[int, set[int], int, set[int]]]:
    """(header, body, outermost header, outermost body) of each step loop: from every outermost loop
    holding HMMAs, descend while an inner loop (a child: no loop between them) holds all of its HMMAs
    and the loop stores to global memory outside it. Such a loop finishes a unit of output per trip:
    it walks blocks, its child the steps (FlashAttention-2's key-block loop writes dK and dV). A loop
    that only wraps its MMAs in an inner loop (autoflash's masked tiles walk key slices) stays the step.
    `bodies`: the natural loops by header (_loop_bodies)."""
    hmma = lambda body: sum(1 for b in body for ins in insns[blocks[b][0]:blocks[b][1]]  # noqa: E731
                            if classify(ins.op, ins.pred) == "HMMA")
    stores = lambda body: any(classify(ins.op, ins.pred) == "STG" for b in body  # noqa: E731
                              for ins in insns[blocks[b][0]:blocks[b][1]])
    found = []
    for h, body in bodies.items():
        if any(body < other for other in bodies.values()):
            continue
        n = hmma(body)
        if not n:
            continue
        head, cur = h, body
        while True:
            inner = [(h2, b2) for h2, b2 in bodies.items() if b2 < cur]
            children = [(h2, b2) for h2, b2 in inner if not any(b2 < b3 for _, b3 in inner)]
            child = next(((h2, b2) for h2, b2 in children if hmma(b2) == n and stores(cur - b2)), None)
            if child is None:
                break
            head, cur = child
        found.append((head, cur, h, body))
    return found


_HGMMA_SHAPE = re.compile(r"^HGMMA\.64x(\d+)x16")


@dataclasses.dataclass(frozen=True)
class WgmmaLoop:
    """A loop of an sm_90a kernel holding wgmma (HGMMA) and no inner loop that does: what one warp
    of a consumer warpgroup issues per trip (FlashAttention-3's forward and autoflash's sm90 family:
    one key tile). `counts` by opcode, `shapes` the HGMMA shapes ("64x176x16": 8)."""

    header_addr: int
    counts: dict[str, int]
    shapes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def mma_equivalents(self) -> int:
        """Tensor-core work per warp in m16n8k16 units: an HGMMA.64xNx16 spreads 64 x N x 16 over a
        warpgroup's 4 warps, N / 8 of mma.sync.m16n8k16's 16 x 8 x 16 each."""
        return sum(int(s.split("x")[1]) // 8 * n for s, n in self.shapes.items())

    @property
    def per_equivalent(self) -> float:
        return self.total / self.mma_equivalents


def hgmma_loops(text: str) -> list[WgmmaLoop]:
    """The innermost loops holding HGMMA (loops inside them, e.g. an mbarrier's try_wait spin, are
    counted once), in address order. A kernel's steady-state loop is the one with the fewest
    instructions; a masked loop beside it carries the masking."""
    insns = parse(text)
    blocks, succ = _blocks(insns)
    bodies, _ = _loop_bodies(len(blocks), succ)
    holds = lambda body: any(insns[i].op.startswith("HGMMA")  # noqa: E731
                             for b in body for i in range(*blocks[b]))
    found = []
    for h, body in bodies.items():
        if not holds(body) or any(other < body and holds(other) for other in bodies.values()):
            continue
        body_insns = [i for b in body for i in insns[blocks[b][0]:blocks[b][1]] if classify(i.op, i.pred) is not None]
        shapes = collections.Counter(m.group(0).split(".")[1] for i in body_insns if (m := _HGMMA_SHAPE.match(i.op)))
        counts = collections.Counter(i.op.split(".")[0] for i in body_insns)
        found.append(WgmmaLoop(insns[blocks[h][0]].addr, dict(counts), dict(shapes)))
    return sorted(found, key=lambda loop: loop.header_addr)


def hmma_loops(text: str) -> list[Loop]:
    """The step loops holding HMMAs (see Loop), in address order."""
    insns = parse(text)
    if not insns:
        return []
    blocks, succ = _blocks(insns)
    bodies, dom = _loop_bodies(len(blocks), succ)
    found = []
    for head, body, top, outermost in _step_loops(insns, blocks, bodies):
        members = [ins for b in sorted(body) for ins in insns[blocks[b][0]:blocks[b][1]]]
        counts = _counts(members)
        # Source lines of the kernel's own template (.cu.j2), not of the headers it includes.
        files = collections.Counter(ins.line[0] for ins in members if ins.line)
        own = [f for f, _ in files.most_common() if f.endswith(".j2")] or [f for f, _ in files.most_common(1)]
        lines = [ins.line[1] for ins in members if ins.line and ins.line[0] in own[:1]]
        nested = any(lp < body for lp in bodies.values())
        latches = [b for b in body if head in succ[b]]
        always = set.intersection(*(dom[b] & body for b in latches)) if latches else set(body)
        conditional = _counts(ins for b in sorted(body - always) for ins in insns[blocks[b][0]:blocks[b][1]])
        outer = None
        if outermost != body:
            outer = (insns[blocks[top][0]].addr,
                     sum(_counts(insns[blocks[b][0]:blocks[b][1]]).total() for b in outermost))
        found.append(Loop(insns[blocks[head][0]].addr, dict(counts), (min(lines), max(lines)) if lines else None,
                          nested, _global_loads(members), (members[0].addr, max(i.addr for i in members)), outer,
                          dict(conditional)))
    return sorted(found, key=lambda lp: lp.header_addr)


def path_instructions(text: str, contract: bool = True) -> int:
    """Instructions along the heaviest path from the kernel's entry with every loop run once and,
    with `contract`, the step loops (hmma_loops) and blocks with HMMAs outside loops (a peeled
    step) left out: the per-block work around the steps
    (prologue, epilogue, FlashAttention-2's outer key-block loop), or with no HMMA loop a helper
    kernel's instructions per warp. NOP padding is not counted."""
    insns = parse(text)
    if not insns:
        return 0
    blocks, succ = _blocks(insns)
    bodies, dom = _loop_bodies(len(blocks), succ)
    node = {b: b for b in range(len(blocks))}
    contracted = set()
    if contract:
        for head, body, _, _ in _step_loops(insns, blocks, bodies):
            for b in body:
                node[b] = head
            contracted.add(head)
    weight = collections.Counter()
    for b, (s, e) in enumerate(blocks):
        # A step outside any loop (a kernel's peeled last step) is step work too, not the block's.
        if contract and any(classify(ins.op, ins.pred) == "HMMA" for ins in insns[s:e]):
            continue
        if node[b] not in contracted:
            weight[node[b]] += sum(1 for ins in insns[s:e] if ins.op != "NOP" and classify(ins.op, ins.pred))
    nexts: dict[int, set[int]] = collections.defaultdict(set)
    for b, ss in succ.items():  # every back edge cut: each loop runs once
        nexts[node[b]].update(node[x] for x in ss if x not in dom[b] and node[x] != node[b])
    return _heaviest_path(node[0], set(node.values()), nexts, weight, lambda a, b: a + b, lambda w: w,
                          "path_instructions: the control flow without back edges")


def _heaviest_path(start, nodes: set, nexts: dict, weight, add, key, what: str):
    """The heaviest of the paths from `start` through the DAG (`nexts`: successors by node), a path
    weighing add(...) of its nodes' weights compared by key(); ValueError saying `what` is not
    acyclic (irreducible control flow) when the nodes have no topological order."""
    indegree = collections.Counter(z for zs in nexts.values() for z in zs)
    best, ready, seen = {start: weight[start]}, [x for x in nodes if not indegree[x]], 0
    while ready:  # longest path in topological order
        a = ready.pop()
        seen += 1
        for z in nexts[a]:
            if a in best:
                path = add(best[a], weight[z])
                if z not in best or key(path) > key(best[z]):
                    best[z] = path
            indegree[z] -= 1
            if not indegree[z]:
                ready.append(z)
    if seen != len(nodes):
        raise ValueError(f"{what} is not acyclic (irreducible)")
    return max(best.values(), key=key)


_WIDTH_BITS = {"8": 8, "16": 16, "32": 32, "64": 64, "128": 128, "U8": 8, "S8": 8, "U16": 16, "S16": 16}


def load_bytes(op: str) -> int:
    """Bytes one thread moves with a global load opcode: its width suffix (LDG.E.64: 8,
    LDGSTS.E.BYPASS.LTC128B.128: 16), 4 without one (LDG.E)."""
    bits = [_WIDTH_BITS[p] for p in op.split(".")[1:] if p in _WIDTH_BITS]
    return (bits[-1] if bits else 32) // 8


def _global_loads(insns) -> dict[str, tuple[int, int]]:
    loads: dict[str, tuple[int, int]] = {}
    for ins in insns:
        kind = ins.op.split(".")[0]
        if kind in ("LDGSTS", "LDG") and classify(ins.op, ins.pred) is not None:
            n, size = loads.get(kind, (0, 0))
            loads[kind] = (n + 1, size + load_bytes(ins.op))
    return loads


def straight_line_loads(text: str) -> dict[str, tuple[int, int]]:
    """Global loads per thread outside every loop (prologue and epilogue), along the path from the
    entry that issues the most LDGSTS bytes: {"LDGSTS" | "LDG": (instructions, bytes)}.

    Each outermost loop is contracted to one node of no weight, which leaves a DAG for ptxas's
    reducible control flow. A path, not the sum over blocks: ptxas versions a copy into a whole-tile
    and a ragged-tile branch, and only one of them runs."""
    insns = parse(text)
    if not insns:
        return {}
    blocks, succ = _blocks(insns)
    loops = _natural_loops(len(blocks), succ)
    outer = [lp for lp in loops if not any(lp < other for other in loops)]
    node = {b: b for b in range(len(blocks))}
    for lp in outer:
        for b in lp:
            node[b] = min(lp)
    looped = {b for lp in outer for b in lp}
    weight: dict[int, dict[str, tuple[int, int]]] = collections.defaultdict(dict)
    for b, (s, e) in enumerate(blocks):
        for kind, (n, size) in ({} if b in looped else _global_loads(insns[s:e])).items():
            m, total = weight[node[b]].get(kind, (0, 0))
            weight[node[b]][kind] = (m + n, total + size)
    nexts: dict[int, set[int]] = collections.defaultdict(set)
    for b, ss in succ.items():
        nexts[node[b]].update(node[s] for s in ss if node[s] != node[b])
    key = lambda w: (w.get("LDGSTS", (0, 0))[1], w.get("LDG", (0, 0))[1])  # noqa: E731
    add = lambda w, v: {k: tuple(x + y for x, y in zip(w.get(k, (0, 0)), v.get(k, (0, 0))))  # noqa: E731
                        for k in set(w) | set(v)}
    return dict(_heaviest_path(node[0], set(node.values()), nexts, weight, add, key,
                               "straight_line_loads: the control flow outside the loops"))


def main_loop(loops: list[Loop]) -> Loop:
    """The steady-state loop: of the step loops without an inner loop that issue the most HMMAs,
    the one with the fewest instructions (the masked variants of a step, peeled into loops of their
    own, add the mask to the same MMAs); else the last loop."""
    if not loops:
        raise ValueError("no loop with tensor-core MMAs (HMMA) in this kernel")
    plain = [lp for lp in loops if not lp.nested]
    if not plain:
        return loops[-1]
    most = max(lp.counts.get("HMMA", 0) for lp in plain)
    return min((lp for lp in plain if lp.counts.get("HMMA", 0) == most), key=lambda lp: (lp.total, -lp.header_addr))


def iteration_counts(text: str, loop: Loop, hmma: int) -> dict[str, int] | None:
    """Per-class counts along the longest path through one iteration of `loop` (its header to a
    back edge) that issues exactly `hmma` HMMAs; None when no path does.

    Where a loop's HMMAs sit in branches picked at run time (a block's head-dim slice, a warp's
    share of a product), its body holds more HMMAs than one iteration issues, and counting the whole
    body charges every iteration with all of them. Inner loops count once. Of the paths with the
    same HMMA count the longest is taken, so other branches still count as if taken (a bound from
    above, like the whole-body count)."""
    if not isinstance(loop, Loop):
        raise TypeError(f"iteration_counts: got {type(loop).__name__}, expected a Loop from hmma_loops")
    insns = parse(text)
    blocks, succ = _blocks(insns)
    bodies, dom = _loop_bodies(len(blocks), succ)
    heads = [h for h in bodies if insns[blocks[h][0]].addr == loop.header_addr]
    if not heads:
        raise ValueError(f"iteration_counts: got a loop at 0x{loop.header_addr:04x}, expected one that starts "
                         f"at one of this listing's loops")
    head = heads[0]
    body = bodies[head]
    counts = {b: collections.Counter(c for ins in insns[blocks[b][0]:blocks[b][1]]
                                     if (c := classify(ins.op, ins.pred)) is not None) for b in body}
    # Edges to a dominator are back edges: to the header they end the iteration, to an inner
    # loop's header they are dropped (its body counts once). What is left is acyclic.
    forward = {b: [s for s in succ[b] if s in body and s not in dom[b]] for b in body}
    indegree = collections.Counter(s for b in body for s in forward[b])
    order, ready = [], [head]
    while ready:
        b = ready.pop()
        order.append(b)
        for s in forward[b]:
            indegree[s] -= 1
            if not indegree[s]:
                ready.append(s)
    # best[b][k]: the longest path from the header through b with k HMMAs (k never decreases).
    best: dict[int, dict[int, collections.Counter]] = {head: {counts[head]["HMMA"]: counts[head]}}
    for b in order:
        for s in forward[b]:
            into = best.setdefault(s, {})
            for k, c in best.get(b, {}).items():
                k2, path = k + counts[s]["HMMA"], c + counts[s]
                if k2 <= hmma and (k2 not in into or sum(path.values()) > sum(into[k2].values())):
                    into[k2] = path
    ends = [best[b][hmma] for b in body if head in succ[b] and b in best and hmma in best[b]]
    return dict(max(ends, key=lambda c: sum(c.values()))) if ends else None


def nvdisasm() -> str:
    """The pip-installed nvdisasm (nvidia-cuda-nvdisasm); RuntimeError saying how to get it."""
    from cuda.pathfinder import find_nvidia_binary_utility

    tool = find_nvidia_binary_utility("nvdisasm")
    if not tool:
        raise RuntimeError("nvdisasm not found: install it with `pip install 'nvidia-cuda-nvdisasm>=13.0,<14'`")
    return tool


def disassemble(cubin: Path | str, kernel: str | None = None) -> str:
    """nvdisasm -c -g of a cubin, no GPU needed; with `kernel`, only that function's section."""
    text = subprocess.run([nvdisasm(), "-c", "-g", str(cubin)], capture_output=True, text=True, check=True).stdout
    if kernel is None:
        return text
    sections = functions(text)
    if kernel not in sections:
        raise ValueError(f"kernel {kernel!r} is not in {cubin}; it holds {sorted(sections)}")
    return sections[kernel]


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)", re.M)


def functions(text: str) -> dict[str, str]:
    """An nvdisasm listing split into its functions' sections, by name."""
    marks = list(_SECTION.finditer(text))
    return {m.group(1): text[m.start():marks[k + 1].start() if k + 1 < len(marks) else len(text)]
            for k, m in enumerate(marks)}


ROW_KEYS = ("HMMA/iter", "insns/HMMA", "LDSM/HMMA", "int/HMMA", "FP+MUFU/HMMA", "LDGSTS/HMMA", "spill/iter",
            "BAR/iter")


def loop_row(loop: Loop) -> dict[str, float]:
    """The figures one report row shows for a main loop (per warp and iteration)."""
    return {
        "HMMA/iter": loop.counts.get("HMMA", 0),
        "insns/HMMA": loop.per_hmma(),
        "LDSM/HMMA": loop.per_hmma("LDSM"),
        "int/HMMA": (loop.counts.get("int/addr", 0) + loop.counts.get("MOV", 0) + loop.counts.get("uniform", 0))
        / max(loop.counts.get("HMMA", 0), 1),
        "FP+MUFU/HMMA": (loop.counts.get("FP", 0) + loop.counts.get("MUFU", 0)) / max(loop.counts.get("HMMA", 0), 1),
        "LDGSTS/HMMA": loop.per_hmma("LDGSTS"),
        "spill/iter": loop.counts.get("LDL/STL", 0),
        "BAR/iter": loop.counts.get("BAR", 0),
    }


def wgmma_report(text: str) -> str:
    """The sm90 family's loops holding HGMMA, per consumer warp and trip, per m16n8k16-equivalent of
    tensor-core work (the unit `bench sass --fa3` compares with FlashAttention-3's in)."""
    loops = hgmma_loops(text)
    if not loops:
        return "no loop with tensor-core MMAs (HMMA or HGMMA): nothing to count per MMA"
    steady = min(loops, key=lambda lp: lp.total)
    out = ["wgmma loops (static SASS, per consumer warp and trip; a proxy, not a timing):"]
    for lp in loops:
        role = "steady loop" if lp is steady else "masked or other loop"
        shapes = ", ".join(f"{n} x {s}" for s, n in sorted(lp.shapes.items()))
        out.append(f"  {role} @0x{lp.header_addr:04x}: {lp.total} instructions, HGMMA {shapes}: "
                   f"{lp.mma_equivalents} m16n8k16-equivalents, {lp.per_equivalent:.3g} instructions each")
        out.append("    " + "  ".join(f"{op} {n}" for op, n in sorted(lp.counts.items(), key=lambda x: -x[1])[:12]))
    return "\n".join(out)


def report(text: str) -> str:
    """The instruction mix of a kernel's loops, as `python -m autoflash.render --sass` prints it."""
    loops = hmma_loops(text)
    if not loops:
        return wgmma_report(text)
    main = main_loop(loops)
    out = ["main-loop instruction mix (static SASS, per warp and iteration; a proxy, not a timing):"]
    for lp in loops:
        role = "main loop" if lp is main else ("masked tiles (per key slice)" if lp.nested else "other loop")
        where = f", template lines {lp.lines[0]}-{lp.lines[1]}" if lp.lines else ""
        inside = f", inside the loop @0x{lp.outer[0]:04x} ({lp.outer[1]} instructions)" if lp.outer else ""
        out.append(f"  {role} @0x{lp.header_addr:04x}{where}: {lp.total} instructions, "
                   f"{lp.counts.get('HMMA', 0)} HMMA{inside}")
        out.append("    " + "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in loop_row(lp).items()))
        out.append("    " + "  ".join(f"{c} {lp.counts[c]}" for c in CLASSES if lp.counts.get(c)))
        if lp.conditional:
            out.append(f"    of them in blocks some iteration skips: {sum(lp.conditional.values())}")
        if lp.global_loads:
            out.append("    global loads per thread: " + ", ".join(
                f"{kind} {n} ({size} B)" for kind, (n, size) in sorted(lp.global_loads.items())))
    return "\n".join(out)
