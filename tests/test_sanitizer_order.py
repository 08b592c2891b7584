"""The sanitizer's happens-before order and register pool (autoflash/emulation/cuda/runtime/order.h,
runtime/wgmma.h set_registers), on bugs planted in the sm90 templates as a kernel author would make
them, on ragged shapes: each is reported by kind at its template line. The races leave the results
inside FlashAttention's accuracy rule (checked: only the order sees them); the sanitizer before the
order (one block-wide epoch per barrier or phase, no pool) reported none of the three."""
import pytest

from autoflash import emulation
from autoflash.kernels.resources import templates_dir
from autoflash.selfcheck import main as selfcheck


def _line(template: str, text: str) -> int:
    lines = (templates_dir() / template).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _run(capsys, *flags) -> tuple[int, str, list]:
    emulation.clear_findings()
    status = selfcheck(["--emulate", "h100", "--sanitize", *flags])
    return status, capsys.readouterr().out, emulation.findings()


def _planted_race(capsys, *flags) -> list:
    """The findings of a planted race, which the sanitizer must report while the results stay inside
    the accuracy rule (the control: the results alone do not show it)."""
    status, out, found = _run(capsys, *flags)
    assert status == 1 and found, out
    assert " OUTSIDE THE RULE" not in out, out
    return found


# The consumer releases a V stage after wgmma.wait_group 1, while the P V wgmma that reads the stage
# may still run: the producer's next TMA load overwrites V under it. 700 keys: the stage is reused.
EARLY_V = ("        release(&smem.empty_k[s]);\n        softmax(it, masked);\n        wgmma_wait<0>();\n"
           "        wgmma_fence_operand(acc_o);\n        release(&smem.empty_v[prev]);\n",
           "        release(&smem.empty_k[s]);\n        release(&smem.empty_v[prev]);\n        softmax(it, masked);\n"
           "        wgmma_wait<0>();\n        wgmma_fence_operand(acc_o);\n")


def test_a_v_stage_released_under_a_running_wgmma_is_a_race(mutate, capsys):
    mutate("fwd", *EARLY_V)
    found = _planted_race(capsys, "--shape", "1,2,1,77,700,64")
    races = [f for f in found if f.kind in ("race", "async") and "flash_fwd_sm90.cu.j2" in f.location]
    # the TMA load that overwrites the stage, checked against the wgmma's read of it
    assert any("wgmma" in f.detail for f in races), [str(f) for f in found]


def test_the_unmutated_forward_is_clean_on_the_same_shape(capsys):
    status, out, found = _run(capsys, "--shape", "1,2,1,77,700,64")
    assert status == 0 and not found, out


# The dQ reduction's barrier counted for one warpgroup where both take part: the hardware forms a
# group of whichever 128 threads arrive first, and the leader reads dQ^T rows the other warpgroup may
# still be writing.
HALF_BARRIER = ("    fence_proxy_async();  // generic stores, read by the reduction (async proxy)\n"
                "    named_barrier_sync(CONSUMER_BAR, 128 * CONSUMERS);",
                "    fence_proxy_async();  // generic stores, read by the reduction (async proxy)\n"
                "    named_barrier_sync(CONSUMER_BAR, 128);")


def test_a_named_barrier_counted_for_half_its_threads_is_a_race(mutate, capsys):
    mutate("bwd", *HALF_BARRIER)
    found = _planted_race(capsys, "--backward", "--shape", "1,2,1,77,133,64")
    assert any(f.kind == "race" for f in found), [str(f) for f in found]
    # and the id's two counts, wherever the generations fall
    assert any(f.kind == "barrier" and "every use of one id" in f.detail for f in found), [str(f) for f in found]


# The consumers ask 8 registers a thread more than the producer gave back: setmaxnreg.inc blocks until
# the pool holds them, which it never will.
MORE_REGISTERS = ("setmaxnreg_inc<CONSUMER_REGS>();", "setmaxnreg_inc<CONSUMER_REGS + 8>();")


def test_setmaxnreg_inc_past_the_pool_is_a_deadlock_naming_the_counts(mutate, capsys):
    mutate("fwd", *MORE_REGISTERS)
    status, out, found = _run(capsys, "--shape", "1,2,1,77,133,64")
    assert status == 1, out
    dead = [f for f in found if "setmaxnreg.inc" in f.detail and "deadlock" in f.detail]
    assert dead, out
    assert "register pool" in dead[0].detail and "at entry" in dead[0].detail
    assert dead[0].location == f"templates/flash_fwd_sm90.cu.j2:{_line('flash_fwd_sm90.cu.j2', 'setmaxnreg_inc<CONSUMER_REGS>')}" \
        or "flash_fwd_sm90.cu.j2" in " ".join(dead[0].frames), str(dead[0])


# ------------------------------------------------------------------ schedules
def _tickets(schedule: str) -> list[int]:
    import host_probes
    import torch

    from autoflash import emulate

    module = host_probes.load(host_probes.render("schedule_probe.cu.j2"), "schedule_probe", ("schedule_probe",), False)
    tickets = torch.full((128,), -1, dtype=torch.int32)
    with emulate("h100", schedule=schedule):
        module.get_function("schedule_probe")((1, 1, 1), (64, 1, 1), (tickets,), shared_mem=16,
                                                names=("tickets",))
    assert sorted(tickets.tolist()) == list(range(128))
    return tickets.tolist()


def test_each_schedule_runs_the_threads_in_its_own_reproducible_order():
    orders = {s: _tickets(s) for s in ("default", "wake", "released-first", "random:1", "random:2")}
    assert all(_tickets(s) == order for s, order in orders.items())  # each reproducible, random from its seed
    assert len({tuple(o) for o in orders.values()}) == len(orders), orders
    # warp 0's tickets against warp 1's second ones (the lanes that end its __syncwarp go straight on):
    # default, the waiters look again only once no thread can run; wake, as soon as the phase completes
    def after_the_waiters(order):
        return sum(x > max(order[:32]) for x in order[96:])
    assert after_the_waiters(orders["default"]) == 0
    assert after_the_waiters(orders["wake"]) >= 30


def test_a_schedule_is_named_as_emulate_accepts_it():
    from autoflash import emulate

    for bad in ("fifo", "random", "random:x", "random:-1"):
        with pytest.raises(ValueError, match="random:SEED"):
            with emulate("h100", schedule=bad):
                pass
    with pytest.raises(TypeError, match="schedule"):
        with emulate("h100", schedule=3):
            pass


# ------------------------------------------------------------------ ownership
# A paged cache's page one past the block table's entry: every read stays inside the cache, so only
# the rule of whose pages a block reads (the block table's row, as far as its sequence's length
# reaches) sees it; the results fall outside the rule too, but that is all the sanitizer before it saw.
OFF_BY_ONE_PAGE = ("pages[n / page_size] * page_stride", "(pages[n / page_size] + 1) * page_stride")


def test_a_page_the_block_table_does_not_name_is_out_of_bounds(mutate, capsys):
    mutate("fwd", *OFF_BY_ONE_PAGE)
    emulation.clear_findings()
    status = selfcheck(["--emulate", "a100", "--sanitize", "--kvcache", "--shape", "3,6,2,4,300,128", "--paged", "32"])
    out = capsys.readouterr().out
    assert status == 1, out
    pages = [f for f in emulation.findings() if f.kind == "out-of-bounds" and "block_table names" in f.detail]
    assert pages, out
    copies = {f"templates/flash_fwd.cu.j2:{_line('flash_fwd.cu.j2', text)}"  # the copies that read the page
              for text in ("copier.copy_any_at(tile, shift", "copier.template copy_at<false>(tile, shift")}
    assert {f.location for f in pages} <= copies, [str(f) for f in pages]
