"""What the tuner prints for people: progress bars on a terminal only (plain lines in a file or a
pipe, where a bar's redraws would pile up behind carriage returns), and "non-causal" where the key
slugs the tables store say "full"."""
import io
import subprocess
import sys

from autoflash.tuning.problem import ProblemKey, slug_label
from autoflash.tuning.progress import Bar, Lines, progress

# One tiny space: d64 fp16 forward on an A100, tiles of 64 or 128, 4 warps, 2 stages (compiled once, cached
# on disk).
TINY = ["--gpu", "a100", "--head-dims", "64", "--dtypes", "fp16", "--directions", "fwd", "--space", "num_stages=2",
        "--space", "num_warps=4", "--space", "block_m=64,128", "--space", "block_n=64,128", "--seqlen-buckets",
        "le1k", "--causal", "both", "--jobs", "1"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _tune(*args):
    """The tuner's run with stdout and stderr piped, read as bytes: text mode would turn each
    carriage return into a newline."""
    proc = subprocess.run([sys.executable, "-m", "autoflash.tune", *TINY, *args], capture_output=True, timeout=600)
    proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_a_piped_tune_prints_lines_not_bars(tmp_path):
    proc = _tune("--backend", "simulated", "--out", str(tmp_path), "--budget", "2")
    assert "\r" not in proc.stdout + proc.stderr
    err = proc.stderr.splitlines()
    assert err[0] == "constraints for a100 (sm_80): 0/8 cfg"
    assert any(line.startswith("constraints for a100 (sm_80): 8/8 cfg; ") and "survive" in line for line in err)
    finished = [line for line in err if line.startswith("[")]
    assert [line.split(":")[0] for line in finished] == ["[1/2] fwd fp16 d64 non-causal le1k",
                                                        "[2/2] fwd fp16 d64 causal le1k"]
    assert all(": 2/2 eval; best " in line and " ms fwd_hd64_fp16_" in line for line in finished)
    table = proc.stdout.splitlines()
    assert any(line.startswith("fwd fp16 d64 non-causal le1k ") for line in table)
    assert "full" not in (proc.stdout + proc.stderr).replace(str(tmp_path), "")


def test_a_piped_dry_run_titles_say_non_causal():
    proc = _tune("--dry-run")
    assert "\r" not in proc.stdout + proc.stderr
    assert "a100 fwd fp16 d64 non-causal (default fwd_hd64_fp16_m" in proc.stdout
    assert "a100 fwd fp16 d64 causal (default fwd_hd64_fp16_causal_m" in proc.stdout
    assert "full" not in proc.stdout + proc.stderr


def test_no_progress_prints_neither():
    proc = _tune("--dry-run", "--no-progress")
    assert "constraints for" not in proc.stderr


def test_a_terminal_gets_a_bar():
    stream = Terminal()
    shown = progress(4, "constraints", unit="cfg", stream=stream)
    assert isinstance(shown, Bar)
    shown.update_to(2)
    shown.status("best 1.0 ms")
    shown.close("done")
    text = stream.getvalue()
    assert "\r" in text and "2/4" in text and "4/4" not in text and "done" in text


def test_a_file_gets_milestone_lines_and_an_end_line():
    stream = io.StringIO()
    shown = progress(8, "constraints", unit="cfg", stream=stream, milestones=3)
    assert isinstance(shown, Lines)
    for done in range(1, 9):
        shown.update_to(done)
    shown.status("shown on a terminal only")
    shown.write("  a message")
    shown.close("5 survive")
    assert stream.getvalue().splitlines() == ["constraints: 0/8 cfg", "constraints: 2/8 cfg", "constraints: 4/8 cfg",
                                              "constraints: 6/8 cfg", "  a message", "constraints: 8/8 cfg; 5 survive"]


def test_progress_off_prints_messages_only():
    for stream in (io.StringIO(), Terminal()):
        shown = progress(8, "key", unit="eval", stream=stream, enabled=False, milestones=3)
        shown.update_to(8)
        shown.write("  trial 3 failed")
        shown.close("best 1.0 ms")
        assert stream.getvalue() == "  trial 3 failed\n"


def test_labels_say_non_causal_and_slugs_stay():
    key = ProblemKey("h100", "fwd", "bf16", 128, False, "le4k")
    assert key.slug == "fwd/bf16/d128/full/le4k" and ProblemKey.from_slug("h100", key.slug) == key
    assert key.label == "fwd bf16 d128 non-causal le4k"
    assert ProblemKey("h100", "bwd", "fp16", 64, True, "le1k", "varlen").label == "bwd fp16 d64 causal le1k varlen"
    decode = ProblemKey.decode("h100", "bf16", 128, "q1", "le32k", "b1-4", False)
    assert decode.label == "decode bf16 d128 q1 le32k b1-4 dense" == slug_label(decode.slug)
